"""Memory strategies: one module per kind, each strategy a small frozen dataclass whose fields are its
recipe options (registry.py says how names, classes and options meet).

`catalog.REGISTRIES` lists every kind's registry; `apply.apply_strategies` is the one place that applies
strategies, in a fixed order.
"""

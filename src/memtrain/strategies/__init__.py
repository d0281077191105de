"""Memory strategies: one module per kind, each a small frozen dataclass whose fields are its options.

`apply_order.apply_strategies` is the one place that applies them, in a fixed order.
"""

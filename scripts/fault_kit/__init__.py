"""Test-only tools: a trainer that injects faults on purpose (`faults`), the fault scenarios that prove
memtrain recovers from them (`scenarios`), and the recipe fuzzer (`recipe_fuzz`).

Why inside the package rather than under tests/: the faults must fire inside real training processes,
including the children `torchrun` starts, which import by module name (`-m fault_kit.faults`).
Nothing in memtrain itself imports this package.
"""

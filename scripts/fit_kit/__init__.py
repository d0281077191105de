"""The pieces of scripts/bench_fit_budget.py: what fits under a memory budget with HF Trainer, accelerate
and memtrain, on a CUDA device made to look smaller (`cuda_mode`) or on the CPU under memtrain's simulated
budget (`cpu_setup`, `cpu_tools`, `cpu_search`, `cpu_report`).

Why a package: the CPU benchmark's three metrics, six tool configurations, searches and report do not fit
one readable script; bench_fit_budget.py stays the one command line. Nothing in memtrain imports this.
"""

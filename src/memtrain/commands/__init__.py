"""The CLI's commands that need more than parsing: which trainer runs (`trainers.py`), `memtrain plan`
(`plan.py`) and `memtrain profile` (`profile.py`)."""

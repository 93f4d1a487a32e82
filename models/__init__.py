"""The checkpoints this project serves: the shipped ones in this folder (target, drafter,
eagle3-head) and published ones fetched on first use into a git-ignored cache (models/fetch.py,
`python -m models fetch NAME`)."""

"""Probes of the LLaDA2-format task models: what they learned and where they fail.
Each runs from the repository root as `python -m lab.probes.<name>`."""

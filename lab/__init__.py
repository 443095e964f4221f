"""The lab: the task generators, the training of the shipped task models and the task
evaluation harness.  Not part of the installed plugin (lab/README.md)."""

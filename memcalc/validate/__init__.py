"""`memcalc validate`: build the configuration in torch, run it, measure it, compare with the Estimate.

Nothing in this package is imported by `estimate` or `plan`; torch is imported lazily inside the functions that
need it (memcalc/validate/cli.py imports it only inside the command body). DESIGN.md section 8.
"""

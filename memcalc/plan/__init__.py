"""`memcalc plan`: enumerate every valid layout for a cluster, evaluate them in bulk with the cost model, rank.

space.py   the search axes, their bounds and the validity rules (with a count of what each rule rejects)
search.py  bulk evaluation (numpy arrays through the array-polymorphic cost model), pruning, ranking, Pareto
render.py  rich tables and the `plan --json` object
cli.py     the `plan` command (registered by memcalc.cli)
"""

"""Pure placement policy for kvflow: the fleet model, live replica state and one scorer per axis.

Nothing in this package imports Temporal workflow code or does network I/O on the decision path.
"""

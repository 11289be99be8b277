"""What an arm earned on a request, and what the arms not played would have earned.

`reward` turns a served request's measured times into its speedup over OFF; `costs` holds
the measured draft and verify costs that price rounds; `replay` scores the other arms on the
same output (exact when greedy, in expectation when sampled); `siblings` extends one K's
measured acceptance to the drafter's other Ks.
"""

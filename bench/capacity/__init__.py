"""GPU capacity, measured strictly (issue 34): the keep-up rule and the knee (`rule`), one
level of one configuration on the H200 per device call (`strict`), the results kept with
what made them (`results`), and the tables rendered from them (`render`).

The engine-side machinery (front-end processes, feeds, ageing) is bench.voxtral_capacity's
and bench.voxtral_age's; this package adds the instrument a broadcaster can bank on.
"""

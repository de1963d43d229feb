"""GPU capacity on one GPU: how many real-time Voxtral sessions it holds.

The engine side, one job per module: the configurations and their levers (`configs`),
feeding a session (`feed`), ageing sessions in bulk steps (`ageing`), the host and how busy
it is (`host`), pinning engine cores (`pinning`), one phase on one front end (`phase`), a
front end's process and pipe (`frontend`), one phase of a configuration over its front ends
(`orchestrate`), the ladder and its knee (`knee`), and what a run reports beyond its rows
(`report`); `python -m bench.voxtral_capacity` is its command line and bench.voxtral_age
measures what aged sessions cost.

Measured strictly (issue 34): the keep-up rule and the knee (`rule`), one level of one
configuration on the H200 per device call (`strict`), the results kept with what made them
(`results`), and the tables rendered from them (`render`): the instrument a broadcaster can
bank on.
"""

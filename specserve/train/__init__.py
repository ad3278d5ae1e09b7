"""`specserve train-mtp`: train an MTP (NextN) draft head for a target model by self-distillation.

data.py        prompts -> chat-templated target responses from the engine (greedy + sampled), cached
attention.py   dense SDPA attention for padded training batches, and the chained-drafting masks
hidden.py      target hidden states (and greedy next tokens) for every position, under no_grad
vocab.py       the reduced draft vocabulary and its coverage
objective.py   draft initialisation and the chained ("training-time test") forward + loss
trainer.py     the optimisation loop
export.py      the draft checkpoint folder the engine loads, and report.json
acceptance.py  held-out greedy accept length through the engine
cli.py         the command line
"""

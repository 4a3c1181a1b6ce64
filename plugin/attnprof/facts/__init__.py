"""facts: one definition of each fact every room needs. dtype sizes (:mod:`.dtypes`), a
model's attention shape from its Hugging Face config (:mod:`.shape`) and the model label
used on every metric (:mod:`.label`). Pure Python: no torch, no vLLM."""

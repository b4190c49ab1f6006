"""SQuAD v1.1 fine-tuning of a local BERT checkpoint.

* :mod:`.data`: SQuAD JSON files, the tokenizer check, features (max length
  384, doc stride 128, original BERT windowing) with character offsets;
* :mod:`.postprocess`: n-best span search over a question's windows (n-best 20,
  max answer length 30) back to answer text;
* :mod:`.evaluate`: the official SQuAD v1.1 exact match and F1 (also runnable
  as ``python -m squad_finetune.evaluate DATASET.json PREDICTIONS.json``);
* :mod:`.train`: the Hydra pipeline (``python -m squad_finetune.train``).
"""

"""BERT pre-training (phase 1 seq 128, phase 2 seq 512) with the package's optimizers.

* :mod:`.vocab`: WordPiece tokenizer from a local ``vocab.txt`` (or one trained locally), checked;
* :mod:`.prepare_data`: raw text -> NVIDIA-layout HDF5 shards of pre-training examples;
* :mod:`.data`: those shards (ours or NVIDIA's) as per-rank micro-batches;
* :mod:`.model`: ``BertForPreTraining`` from a config (no hub);
* :mod:`.train`: the Hydra pipeline (``python -m bert.train experiment=bert/phase1_slamb``);
* :mod:`.demo`: the offline CPU check of the whole chain on Python's own docstrings.
"""

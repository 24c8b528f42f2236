"""EncoderRunner: the runner of an encoder (BERT) that only embeds. The same interface as ModelRunner (`execute`
a StepPlan, the sizes the engine reads), without a KV cache.

Each scheduled sequence is a whole input (the scheduler never chunks an encoder's: `Sequence.whole`), and each is
run alone, unpadded: an input's vector then depends on nothing but the input, bitwise, whatever else the step holds
(a padded batch through transformers' module changed the last bits with its neighbours; the determinism shoal
promises covers embeddings too). Its rows are laid out as `forward_batch` lays them out, for the same pooling call
as a decoder's (runner/pooling.py). The engine's block accounting runs on
a pool of zero-byte blocks: nothing is written to them, and no prefix cache is kept (a prefix's hidden states
depend on what follows it).

A cross-encoder (model/bert.py) scores instead: each input is a pair `[CLS] q [SEP] d [SEP]`, whose segment ids
(BERT's token_type_ids) are 0 up to the first [SEP] and 1 after it, and each sequence's part is the classifier's
logits through the model's activation (`score`), transformers' own BertForSequenceClassification forward, as
sentence-transformers' CrossEncoder.predict runs it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from shoal.runner.model_runner import StepLogits, forward_batch
from shoal.runner.pooling import pool
from shoal.types import StepOutput, StepPlan


class EncoderRunner:
    causal = False  # the engine keeps no prefix cache and computes each input whole

    def __init__(self, model, config, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 score=None, sep_token_id: int | None = None) -> None:
        self.model = model
        self.config = config  # model.config.ModelConfig (model/bert.encoder_config)
        self.device = device
        self.dtype = dtype
        self.kv_dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = 0
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.attention = SimpleNamespace(name="encoder")
        self.encoder = None  # no image encoder cache
        self.score = score  # a cross-encoder's activation on its logits (model/bert.score_activation); None: it embeds
        self.sep_token_id = sep_token_id  # where a pair's second segment starts (after the first [SEP])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        batch, seqs = forward_batch(plan)
        if batch.empty or not batch.pool_rows:
            return StepOutput([], {})
        inputs = [torch.tensor([s.token_ids], dtype=torch.long, device=self.device) for s in seqs]  # [1, L] each
        if self.score is not None:
            return self._scores(seqs, inputs)
        # [T, H]: each sequence's rows in turn, as forward_batch lays them
        hidden = torch.cat([self.model(input_ids=ids).last_hidden_state[0] for ids in inputs])
        pooled = pool(hidden, batch.pool_rows, batch.pool_lengths)
        logits = StepLogits(None, [], pooled)
        return StepOutput([], {}, dict(zip((s.seq_id for s in seqs if s.pool), logits.pooled.tolist())))

    def _scores(self, seqs, inputs: list[torch.Tensor]) -> StepOutput:
        """A cross-encoder's step: each pair's logits through the activation, [num_labels] per sequence."""
        logits = []
        for s, ids in zip(seqs, inputs):
            types = torch.zeros_like(ids)
            if self.sep_token_id in s.token_ids:
                types[0, s.token_ids.index(self.sep_token_id) + 1 :] = 1
            logits.append(self.model(input_ids=ids, token_type_ids=types).logits[0])  # [num_labels]
        scores = self.score(torch.stack(logits).float()).double()
        rows = [i for i, s in enumerate(seqs) if s.pool]
        return StepOutput([], {}, dict(zip((seqs[i].seq_id for i in rows), scores[rows].tolist())))

    # the prefix cache's second tier and copy-on-write never run without a prefix cache
    def read_blocks(self, block_ids, group=0):
        return []

    def copy_blocks(self, copies) -> None:
        pass

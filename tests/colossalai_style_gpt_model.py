"""The model, loss and data of tests/colossalai_style_gpt.py (train_gpt_demo.py's GPTLMModel and GPTLMLoss over a
small Hugging Face GPT-2), which the test's plain PyTorch reference builds too."""

import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, BATCH, STEPS, LR = 256, 32, 8, 3, 1e-3


class GPTLMLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


class GPTLMModel(nn.Module):
    """The demo's wrapper: a Hugging Face GPT-2 whose forward takes (input_ids, attention_mask), returns logits."""

    def __init__(self, hidden_size=64, num_layers=2, num_attention_heads=4, max_seq_len=SEQ, vocab_size=VOCAB,
                 checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint
        self.model = GPT2LMHeadModel(GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=num_attention_heads,
                                                n_positions=max_seq_len, n_ctx=max_seq_len, vocab_size=vocab_size,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=not self.checkpoint)[0]


def gpt2_tiny(seed: int = 0) -> GPTLMModel:
    torch.manual_seed(seed)
    return GPTLMModel()


def token_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

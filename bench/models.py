"""The benchmarks' models: two synthetic ones and a real-model set built from library configs.

Every model is an nn.Module that takes one input tensor and returns one tensor (the training
step is ``model(x).float().pow(2).mean().backward()``), built from a seed, so DDP and
FusedReducer start from identical weights and see identical inputs. Nothing is downloaded:
torchvision and transformers build their models from configs with random weights. Dropout is
off (its random masks would differ between the wrappers and the gradients could not be
compared).

  large        transformer-like blocks (LayerNorm, single-head causal attention qkv + proj,
               MLP 4x): 12 tensors and ~12*hidden^2 parameters per block; defaults 4 x 768,
               batch 2 x seq 16: 28.4M parameters in 50 tensors.
  many-small   hundreds of tiny residual Linear(hidden, hidden) layers; defaults 200 x 64,
               batch 32: 400 tensors, 0.83M parameters.
  resnet18     torchvision resnet18(num_classes=10), batch 8 of 3 x 32 x 32 images (--seq is
               the image side): 11.2M parameters in 62 tensors.
  resnet50     torchvision resnet50(num_classes=10), batch 4 of 3 x 32 x 32: 23.5M parameters
               in 161 tensors.
  resnet18-cl, resnet50-cl
               the same in channels_last memory format (weights and inputs), the format vision
               users pick for speed; their gradients are channels_last too.
  gpt2         transformers GPT2LMHeadModel from a GPT2Config: 2 layers (--layers), 128 wide
               (--hidden), 2 heads, GPT-2's vocabulary (50257), tied input/output embeddings;
               batch 4 x seq 32 token ids; the output is the logits. 6.7M parameters in 29
               tensors.
  bert         transformers BertForMaskedLM from a small BertConfig: 2 layers, 128 wide, 2
               heads, intermediate 512, BERT's vocabulary (30522), tied decoder; batch 4 x seq
               32. 4.4M parameters in 42 tensors.

The held-out set (HOLDOUT, alias "holdout"): models the planner's cost model was never
developed or tuned on, for its out-of-sample validation (docs/PLANNING.md section 4):

  mobilenet_v2 torchvision mobilenet_v2(num_classes=10), batch 8 of 3 x 32 x 32: 2.2M
               parameters in 158 tensors (depthwise convolutions, many small tensors).
  densenet121  torchvision densenet121(num_classes=10), batch 4 of 3 x 32 x 32: 7.0M parameters
               in 364 tensors (concatenating blocks: gradients ready in a long, even trickle).
  llama        transformers LlamaForCausalLM from a small LlamaConfig: 2 layers, 128 wide, 2
               heads, intermediate 512, a 32000 vocabulary, untied input and output embeddings
               (two 16 MB tensors at the two ends of backward); batch 4 x seq 32.

torchvision and transformers are optional (the bench extra: ``pip install .[bench]``); asking
for a model whose library is missing raises MissingLibrary with that command.
"""
import torch
import torch.nn.functional as F
from torch import nn

SYNTHETIC = ("large", "many-small")
REAL = ("resnet18", "resnet18-cl", "resnet50", "resnet50-cl", "gpt2", "bert")
HOLDOUT = ("mobilenet_v2", "densenet121", "llama")
MODELS = SYNTHETIC + REAL + HOLDOUT
# Aliases accepted by --model: the issue-10 set is REAL + SYNTHETIC.
ALIASES = {"synthetic": SYNTHETIC, "real": REAL, "all": REAL + SYNTHETIC, "holdout": HOLDOUT}
VISION = ("resnet18", "resnet18-cl", "resnet50", "resnet50-cl", "mobilenet_v2", "densenet121")

# layers / hidden / batch / seq per model (seq: sequence length; for the ResNets the image side).
MODEL_DEFAULTS = {
    "large": {"layers": 4, "hidden": 768, "batch": 2, "seq": 16},
    "many-small": {"layers": 200, "hidden": 64, "batch": 32, "seq": None},
    "resnet18": {"layers": None, "hidden": None, "batch": 8, "seq": 32},
    "resnet18-cl": {"layers": None, "hidden": None, "batch": 8, "seq": 32},
    "resnet50": {"layers": None, "hidden": None, "batch": 4, "seq": 32},
    "resnet50-cl": {"layers": None, "hidden": None, "batch": 4, "seq": 32},
    "gpt2": {"layers": 2, "hidden": 128, "batch": 4, "seq": 32},
    "bert": {"layers": 2, "hidden": 128, "batch": 4, "seq": 32},
    "mobilenet_v2": {"layers": None, "hidden": None, "batch": 8, "seq": 32},
    "densenet121": {"layers": None, "hidden": None, "batch": 4, "seq": 32},
    "llama": {"layers": 2, "hidden": 128, "batch": 4, "seq": 32},
}
LIBRARY = {"resnet18": "torchvision", "resnet18-cl": "torchvision", "resnet50": "torchvision",
           "resnet50-cl": "torchvision", "gpt2": "transformers", "bert": "transformers",
           "mobilenet_v2": "torchvision", "densenet121": "torchvision", "llama": "transformers"}
INSTALL_HINT = "pip install '.[bench]'  (torchvision 0.29.1 and transformers)"
VOCAB = {"gpt2": 50257, "bert": 30522, "llama": 32000}


class MissingLibrary(RuntimeError):
    pass


def require(name):
    """Import the library model `name` needs; MissingLibrary naming the bench extra if absent."""
    lib = LIBRARY.get(name)
    if lib is None:
        return None
    try:
        return __import__(lib)
    except ImportError as e:
        raise MissingLibrary(f"model {name!r} needs {lib}, which is not installed ({e}); "
                             f"install the bench extra: {INSTALL_HINT}") from None


def expand(names):
    """Model names with aliases expanded, duplicates dropped, order kept."""
    out = []
    for n in names:
        out.extend(ALIASES.get(n, (n,)))
    return list(dict.fromkeys(out))


# -- synthetic ----------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LayerNorm transformer block with single-head causal attention."""

    def __init__(self, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TransformerLike(nn.Module):
    def __init__(self, layers, hidden):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


class ManySmall(nn.Module):
    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


# -- real ---------------------------------------------------------------------------------------
class Logits(nn.Module):
    """A transformers model called on token ids, returning its logits (one tensor out)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _vision(name):
    require(name)
    import torchvision
    model = getattr(torchvision.models, name.split("-")[0])(weights=None, num_classes=10)
    for module in model.modules():  # dropout off (mobilenet_v2's classifier), as everywhere here
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if name.endswith("-cl"):
        model = model.to(memory_format=torch.channels_last)
    return model


def _gpt2(layers, hidden):
    require("gpt2")
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=2, n_positions=256,
                        vocab_size=VOCAB["gpt2"], resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, tie_word_embeddings=True)
    return Logits(GPT2LMHeadModel(config))


def _bert(layers, hidden):
    require("bert")
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig(vocab_size=VOCAB["bert"], hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=4 * hidden,
                        max_position_embeddings=256, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, tie_word_embeddings=True)
    return Logits(BertForMaskedLM(config))


def _llama(layers, hidden):
    require("llama")
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB["llama"], hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=4 * hidden, max_position_embeddings=256,
                         attention_dropout=0.0, tie_word_embeddings=False)
    return Logits(LlamaForCausalLM(config))


def fsdp2_blocks(name, model):
    """The submodules torch's FSDP2 is applied to before the root (common.fsdp2_wrap), as
    torchtitan applies it: each repeated block (transformer layer, ResNet block). many-small
    gets none (the root alone: its layers are 16 KB each, one group per layer would be 200
    collectives against DDP's 1-2 buckets); the memory bench's Linear stack is bench/memory_bench.py's."""
    if name == "large":
        return list(model.blocks)
    if name.startswith("resnet"):
        return [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    if name == "gpt2":
        return list(model.model.transformer.h)
    if name == "bert":
        return list(model.model.bert.encoder.layer)
    if name == "llama":
        return list(model.model.model.layers)
    if name == "mobilenet_v2":
        return list(model.features)
    if name == "densenet121":
        return [m for n, m in model.features.named_children() if n.startswith(("denseblock", "transition"))]
    return []


class ModelSpec:
    """A model of the set with its sizes: build() it (seeded) and make its inputs."""

    def __init__(self, name, layers, hidden, batch, seq, seed):
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        self.name, self.layers, self.hidden = name, layers, hidden
        self.batch, self.seq, self.seed = batch, seq, seed

    @classmethod
    def from_args(cls, name, layers=None, hidden=None, batch=None, seq=None, seed=0):
        d = MODEL_DEFAULTS[name]
        return cls(name, layers or d["layers"], hidden or d["hidden"], batch or d["batch"],
                   seq or d["seq"], seed)

    @property
    def channels_last(self):
        return self.name.endswith("-cl")

    def build(self, device):
        torch.manual_seed(self.seed)
        if self.name == "large":
            model = TransformerLike(self.layers, self.hidden)
        elif self.name == "many-small":
            model = ManySmall(self.layers, self.hidden)
        elif self.name in VISION:
            model = _vision(self.name)
        elif self.name == "gpt2":
            model = _gpt2(self.layers, self.hidden)
        elif self.name == "llama":
            model = _llama(self.layers, self.hidden)
        else:
            model = _bert(self.layers, self.hidden)
        model = model.to(device)
        if self.channels_last:  # .to(device) keeps the format; make sure of it anyway
            model = model.to(memory_format=torch.channels_last)
        return model

    def input(self, rank, index, device):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + index)
        if self.name == "large":
            return torch.randn((self.batch, self.seq, self.hidden), generator=g).to(device)
        if self.name == "many-small":
            return torch.randn((self.batch, self.hidden), generator=g).to(device)
        if self.name in VISION:
            x = torch.randn((self.batch, 3, self.seq, self.seq), generator=g).to(device)
            return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
        return torch.randint(0, VOCAB[self.name], (self.batch, self.seq), generator=g).to(device)

    def shape(self):
        if self.name == "large":
            return f"{self.layers} blocks x hidden {self.hidden}, batch {self.batch} x seq {self.seq}"
        if self.name == "many-small":
            return f"{self.layers} layers x hidden {self.hidden}, batch {self.batch}"
        if self.name in VISION:
            fmt = "channels_last" if self.channels_last else "contiguous"
            return (f"torchvision {self.name.split('-')[0]}(num_classes=10), {fmt}, batch "
                    f"{self.batch} x 3 x {self.seq} x {self.seq}")
        what = {"gpt2": "GPT2LMHeadModel, 2 heads, tied embeddings",
                "bert": "BertForMaskedLM, 2 heads, tied decoder",
                "llama": "LlamaForCausalLM, 2 heads, untied embeddings"}[self.name]
        return (f"transformers {what}: {self.layers} layers x {self.hidden}, vocab "
                f"{VOCAB[self.name]}, batch {self.batch} x seq {self.seq}")

    def describe(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        return {"model": self.name, "layers": self.layers, "hidden": self.hidden,
                "batch": self.batch, "seq": self.seq if self.name != "many-small" else None,
                "channels_last": self.channels_last,
                "params": numel, "tensors": len(params), "grad_bytes": grad_bytes,
                "shape": self.shape()}

"""Healthy real architectures, built from code with nothing downloaded: every torchvision
classifier that fits a 2-core CPU at a tiny input, a few torchvision detection and
segmentation models, one model per timm family (its smallest variant) and Hugging Face
models from tiny configs. ``run(entry)`` trains one a few correct steps under
``gradrepro.record(every=1)`` and then gives it to ``gradrepro.diagnose``; what it returns
is every warning and error either said, and any crash.

Used by ``tests/test_zoo.py`` and ``benchmarks/zoo_score.py``. ``half(name)`` splits the zoo
in two fixed halves by a hash of the name: rules are designed against ``design`` and scored
on ``scored``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import gradrepro
from gradrepro.diagnose import diagnose

CLASSES = 10
# Parameters a model may have to fit: what a tiny step on a 2-core CPU allows in seconds
# (torchvision's ViT-B/16 at 86M and the large RegNets are left out).
MAX_PARAMS = 30_000_000
STEPS, BATCH, SIZE, SEQ = 3, 2, 32, 8
# GoogLeNet's auxiliary classifiers enter the loss with weight 0.3 (Szegedy et al. 2015, Sec. 5);
# torchvision's segmentation references weigh the auxiliary head's loss by 0.5.
AUX_WEIGHT_GOOGLENET, AUX_WEIGHT_SEGMENTATION = 0.3, 0.5


@dataclass(frozen=True)
class Entry:
    """One model of the zoo: how to build it, make a batch and compute its loss."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[torch.Generator, int, int], Any]  # (generator, batch size, input size) -> batch
    loss: Callable[[nn.Module, Any], torch.Tensor]
    size: int = SIZE  # the input size it fits at (images: pixels; text: tokens)
    # For a model built for one input size (a transformer's fixed patch grid): the model built
    # for another size, which run(size=...) uses when the size is not ``size``.
    build_at: Optional[Callable[[int], nn.Module]] = None


@dataclass
class Outcome:
    name: str
    flagged: list = field(default_factory=list)  # (source, severity, kind, tensor, detail)
    crash: str = ""  # an exception from gradrepro, or in a loop that runs without it
    unfit: str = ""  # the model fails without gradrepro too: it does not fit at this size

    @property
    def kinds(self) -> list[str]:
        return sorted({f"{s}:{k}" for s, _, k, _, _ in self.flagged})


def half(name: str) -> str:
    """``design`` or ``scored``, fixed by the name's SHA-256 (even or odd)."""
    return "design" if int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2 == 0 else "scored"


# -- data and losses ----------------------------------------------------------------------------
def images(g: torch.Generator, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def classify(model: nn.Module, b: Any) -> torch.Tensor:
    """Cross-entropy of the logits; auxiliary classifiers (GoogLeNet) enter with their weight."""
    x, y = b
    out = model(x)
    if isinstance(out, tuple):  # GoogLeNetOutputs(logits, aux_logits2, aux_logits1)
        main, aux = out[0], [a for a in out[1:] if a is not None]
        return F.cross_entropy(main, y) + AUX_WEIGHT_GOOGLENET * sum(F.cross_entropy(a, y) for a in aux)
    return F.cross_entropy(out, y)


def boxes(g: torch.Generator, batch: int, size: int) -> tuple[list, list]:
    imgs = [torch.rand(3, size, size, generator=g) for _ in range(batch)]
    targets = []
    for _ in range(batch):
        xy = torch.rand(2, 2, generator=g) * size / 2
        wh = size / 4 + torch.rand(2, 2, generator=g) * size / 4
        box = torch.cat([xy, xy + wh], 1).clamp(max=size - 1)
        label = torch.randint(1, 3, (2,), generator=g)
        masks = torch.zeros(2, size, size, dtype=torch.uint8)
        for k, (x0, y0, x1, y1) in enumerate(box.long().tolist()):
            masks[k, y0:y1, x0:x1] = 1
        targets.append({"boxes": box, "labels": label, "masks": masks})
    return imgs, targets


def detection_loss(model: nn.Module, b: Any) -> torch.Tensor:
    imgs, targets = b
    return sum(model(imgs, targets).values())


def pixels(g: torch.Generator, batch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 3, (batch, size, size), generator=g)


def segmentation_loss(model: nn.Module, b: Any) -> torch.Tensor:
    x, t = b
    out = model(x)
    loss = F.cross_entropy(out["out"], t)
    return loss + AUX_WEIGHT_SEGMENTATION * F.cross_entropy(out["aux"], t) if "aux" in out else loss


# -- torchvision -----------------------------------------------------------------------------------
def _tv_kwargs(name: str) -> dict:
    if name == "googlenet":
        return {"aux_logits": True, "init_weights": True}
    if name == "inception_v3":  # its auxiliary head needs 299x299 inputs: left out at 75x75
        return {"aux_logits": False, "init_weights": True}
    if name.startswith("vit_"):
        return {"image_size": TV_SIZE}
    return {}


# torchvision's classifiers downsample by 32: at 32x32 their last stage is 1x1, and a batch of
# 2 leaves a train-mode BatchNorm 2 values per channel, whose normalised output is +-1 whatever
# its input (PyTorch refuses only 1 value). RegNet-Y and EfficientNet then blow up (parameter
# norms near 1e9 after 3 plain SGD steps at lr 0.01) without gradrepro; at 64x64 (8 values per
# channel, 2x2 at the last stage) they train. The zoo feeds them 64x64, as it does timm's.
TV_SIZE = 64
_TV_SIZE = {"inception_v3": 75}


def torchvision_classifiers() -> list[Entry]:
    import torchvision

    out = []
    for name in torchvision.models.list_models(module=torchvision.models):
        build = functools.partial(torchvision.models.get_model, name, weights=None, num_classes=CLASSES,
                                  **_tv_kwargs(name))
        # torchvision's weight metadata counts the parameters (1000 classes) without building it
        params = torchvision.models.get_model_weights(name).DEFAULT.meta["num_params"]
        if params <= MAX_PARAMS:
            out.append(Entry(f"tv/{name}", build, images, classify, _TV_SIZE.get(name, TV_SIZE)))
    return out


def torchvision_dense() -> list[Entry]:
    """A few detection and segmentation models, untrained backbones, small images."""
    from torchvision.models import detection, segmentation

    small = {"weights": None, "weights_backbone": None, "num_classes": 3}
    resize = {"min_size": 64, "max_size": 64}
    det = {
        "fasterrcnn_mobilenet_v3_large_320_fpn": lambda: detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            **small, **resize),
        "retinanet_resnet50_fpn": lambda: detection.retinanet_resnet50_fpn(**small, **resize),
        "fcos_resnet50_fpn": lambda: detection.fcos_resnet50_fpn(**small, **resize),
        "maskrcnn_resnet50_fpn": lambda: detection.maskrcnn_resnet50_fpn(**small, **resize),
        "ssdlite320_mobilenet_v3_large": lambda: detection.ssdlite320_mobilenet_v3_large(**small),
    }
    seg = {
        "fcn_resnet50": lambda: segmentation.fcn_resnet50(**small, aux_loss=True),
        "deeplabv3_mobilenet_v3_large": lambda: segmentation.deeplabv3_mobilenet_v3_large(**small, aux_loss=True),
        "lraspp_mobilenet_v3_large": lambda: segmentation.lraspp_mobilenet_v3_large(**small),
    }
    return ([Entry(f"tv/{n}", b, boxes, detection_loss, 64) for n, b in det.items()]
            + [Entry(f"tv/{n}", b, pixels, segmentation_loss, 64) for n, b in seg.items()])


# -- timm: one model per family ---------------------------------------------------------------
# The smallest variant of each family with at most MAX_PARAMS parameters, chosen by name
# (atto, femto, pico, nano, tiny, small, ... first) and counted on the meta device.
TIMM = (
    "botnet50ts_256", "gernet_s", "cait_xxs24_224", "coat_tiny", "convit_tiny", "convmixer_768_32",
    "convnext_atto", "cpubone_nano", "crossvit_tiny_240", "csatv2", "cs3darknet_focus_l", "cspnext_tiny",
    "davit_tiny", "deit_tiny_patch16_224", "densenet121", "dla34", "dpn68", "edgenext_small",
    "efficientformer_l1", "efficientformerv2_s0", "mobilenet_edgetpu_v2_xs", "efficientvim_m1",
    "efficientvit_b0", "efficientvit_m0", "eva02_tiny_patch14_224", "fasternet_s", "fastvit_s12",
    "focalnet_tiny_lrf", "gcvit_tiny", "ghostnet_050", "hardcorenas_a", "hgnet_tiny", "hiera_tiny_224",
    "sam2_hiera_tiny", "hrnet_w18_small", "iformer_s", "inception_next_atto", "inception_v3", "lcnetv2_small",
    "levit_128", "lowformer_b0", "mambaout_femto", "maxvit_pico_rw_256", "caformer_s18", "gmlp_s16_224",
    "tf_mobilenetv3_large_minimal_100", "mobilevit_xxs", "mvitv2_tiny", "nest_tiny", "nf_seresnet26",
    "pit_xs_224", "pvt_v2_b0", "rdnet_tiny", "regnety_040_sgn", "repghostnet_050", "repvit_m1", "res2net50d",
    "resnest14d", "resnet18", "resnetv2_18", "rexnet_100", "selecsls42", "legacy_seresnet18", "sequencer2d_s",
    "shvit_s1", "skresnet18", "starnet_s1", "swiftformer_xs", "swin_s3_tiny_224", "swinv2_tiny_window8_256",
    "swinv2_cr_tiny_224", "tiny_vit_5m_224", "tnt_s_patch16_224", "tresnet_m", "twins_svt_small",
    "visformer_tiny", "vit_xsmall_patch16_clip_224", "vit_tiny_r_s16_p8_224", "vit_relpos_small_patch16_224",
    "vitamin_small_224", "volo_d1_224", "ese_vovnet19b_slim", "legacy_xception", "xception41",
    "xcit_nano_12_p8_224",
)


def _timm(name: str, size: int) -> nn.Module:
    import timm

    try:  # transformers with a fixed grid take the small image size; CNNs take any size
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, img_size=size)
    except TypeError:
        return timm.create_model(name, pretrained=False, num_classes=CLASSES)


def timm_families() -> list[Entry]:
    return [Entry(f"timm/{n}", lambda n=n: _timm(n, 64), images, classify, 64, lambda size, n=n: _timm(n, size))
            for n in TIMM]


# -- Hugging Face transformers from tiny configs ---------------------------------------------------
VOCAB = 128
_TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 64}
_DECODER = {**_TEXT, "num_key_value_heads": 1}


def _hf(model: str, config: str, **cfg: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**cfg))
    return build


def tokens(g: torch.Generator, batch: int, size: int) -> dict:
    ids = torch.randint(3, VOCAB, (batch, size), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def sequence_labels(g: torch.Generator, batch: int, size: int) -> dict:
    return {"input_ids": torch.randint(3, VOCAB, (batch, size), generator=g),
            "labels": torch.randint(0, 3, (batch,), generator=g)}


def vision_labels(g: torch.Generator, batch: int, size: int) -> dict:
    x, y = images(g, batch, size)
    return {"pixel_values": x, "labels": y}


# CLIP's text tower pools the hidden state at the first end-of-text token (its config's
# eos_token_id), which its tokenizer puts at the end of every text, after a start-of-text token
# at the beginning. The tiny config's two tokens are the vocabulary's last ids (CLIPConfig's own,
# 49406 and 49407, lie outside a 128-token vocabulary: no position matched, and the tower pooled
# position 0, which the causal mask lets attend to itself alone).
CLIP_BOS, CLIP_EOS = VOCAB - 2, VOCAB - 1


def image_text(g: torch.Generator, batch: int, size: int) -> dict:
    ids = torch.randint(3, CLIP_BOS, (batch, SEQ), generator=g)
    ids[:, 0], ids[:, -1] = CLIP_BOS, CLIP_EOS
    return {"input_ids": ids, "pixel_values": torch.randn(batch, 3, size, size, generator=g), "return_loss": True}


def audio(g: torch.Generator, batch: int, size: int) -> dict:  # size: the mel frames (2 x source positions)
    return {"input_features": torch.randn(batch, 16, size, generator=g),
            "labels": torch.randint(3, VOCAB, (batch, SEQ), generator=g)}


def hf_loss(model: nn.Module, b: dict) -> torch.Tensor:
    return model(**b).loss


def huggingface() -> list[Entry]:
    vit = {"image_size": SIZE, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 64, "num_labels": CLASSES}
    seq2seq = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
               "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
               "decoder_ffn_dim": 64, "max_position_embeddings": 64}
    causal = {
        "gpt2": _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                    n_head=2),
        "llama": _hf("LlamaForCausalLM", "LlamaConfig", **_DECODER),
        "mistral": _hf("MistralForCausalLM", "MistralConfig", **_DECODER),
        "mixtral": _hf("MixtralForCausalLM", "MixtralConfig", **_DECODER, num_local_experts=4,
                       num_experts_per_tok=2),
        "qwen2": _hf("Qwen2ForCausalLM", "Qwen2Config", **_DECODER),
        "gemma": _hf("GemmaForCausalLM", "GemmaConfig", **_DECODER, head_dim=16),
        "phi": _hf("PhiForCausalLM", "PhiConfig", **_TEXT),
        "gpt_neox": _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_TEXT),
        "opt": _hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=2, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32),
        "bloom": _hf("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2),
        "bert_mlm": _hf("BertForMaskedLM", "BertConfig", **_TEXT),
        "roberta_mlm": _hf("RobertaForMaskedLM", "RobertaConfig", **{**_TEXT, "max_position_embeddings": 66}),
        "albert_mlm": _hf("AlbertForMaskedLM", "AlbertConfig", **_TEXT, embedding_size=16),
        "deberta_v2_mlm": _hf("DebertaV2ForMaskedLM", "DebertaV2Config", **_TEXT),
        "t5": _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
                  num_layers=2, num_heads=2, decoder_start_token_id=0),
        "bart": _hf("BartForConditionalGeneration", "BartConfig", **seq2seq),
    }
    classify_text = {
        "bert_cls": _hf("BertForSequenceClassification", "BertConfig", **_TEXT, num_labels=3),
        "distilbert_cls": _hf("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=VOCAB, dim=32,
                              n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, num_labels=3),
        "electra_cls": _hf("ElectraForSequenceClassification", "ElectraConfig", **_TEXT, embedding_size=16,
                           num_labels=3),
    }
    vision = {
        "vit": _hf("ViTForImageClassification", "ViTConfig", **vit),
        "swin": _hf("SwinForImageClassification", "SwinConfig", image_size=SIZE, patch_size=4, embed_dim=16,
                    depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=CLASSES),
        "convnext": _hf("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1],
                        num_labels=CLASSES),
    }
    def clip(size: int = SIZE) -> nn.Module:
        text = {**_TEXT, "max_position_embeddings": 16, "bos_token_id": CLIP_BOS,
                "eos_token_id": CLIP_EOS}
        return _hf("CLIPModel", "CLIPConfig", projection_dim=16, text_config=text,
                   vision_config={**{k: v for k, v in vit.items() if k != "num_labels"}, "image_size": size})()

    def whisper(size: int = 32) -> nn.Module:  # size: mel frames, twice the encoder's positions
        return _hf("WhisperForConditionalGeneration", "WhisperConfig", **seq2seq, num_mel_bins=16,
                   max_source_positions=size // 2, max_target_positions=32, decoder_start_token_id=1,
                   pad_token_id=0)()

    sized = {"vit": lambda size: _hf("ViTForImageClassification", "ViTConfig", **{**vit, "image_size": size})()}
    return ([Entry(f"hf/{n}", b, tokens, hf_loss, SEQ) for n, b in causal.items()]
            + [Entry(f"hf/{n}", b, sequence_labels, hf_loss, SEQ) for n, b in classify_text.items()]
            + [Entry(f"hf/{n}", b, vision_labels, hf_loss, SIZE, sized.get(n)) for n, b in vision.items()]
            + [Entry("hf/clip", clip, image_text, hf_loss, SIZE, clip),
               Entry("hf/whisper", whisper, audio, hf_loss, 32, whisper)])


def entries() -> dict[str, Entry]:
    """The whole zoo by name."""
    return {e.name: e for e in torchvision_classifiers() + torchvision_dense() + timm_families() + huggingface()}


# -- one model's run ------------------------------------------------------------------------------
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
}


def _train(entry: Entry, optimizer: str, steps: int, batch: int, size: int, seed: int,
           record_to: Optional[str]) -> tuple[list, Any, list]:
    """``steps`` textbook steps (zero_grad, forward, backward, step); recorded into
    ``record_to`` (every step) when given. Returns the recorder's findings, the report and the
    losses."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = (entry.build_at(size) if entry.build_at is not None and size != entry.size else entry.build()).train()
    opt = OPTIMIZERS[optimizer](model.parameters())
    rec = (gradrepro.record(model, opt, record_to, every=1, on_finding="log", steps=steps)
           if record_to else None)
    losses = []
    try:
        for _ in range(steps):
            b = entry.data(g, batch, size)
            opt.zero_grad()
            loss = entry.loss(model, b)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        if rec is not None:
            rec.close()
    found = rec.findings() if rec is not None else []
    b = entry.data(g, batch, size)
    report = diagnose(model, opt, lambda: entry.loss(model, b)) if rec is not None else None
    return found, report, losses


def run(entry: Entry, optimizer: str = "sgd", steps: int = STEPS, batch: int = BATCH, size: Optional[int] = None,
        seed: int = 0) -> Outcome:
    """Train ``entry`` under the recorder, then diagnose it: every warning and error, or the crash."""
    size = size or entry.size
    out = Outcome(entry.name)
    logging.getLogger("gradrepro.watch.watcher").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            found, report, _ = _train(entry, optimizer, steps, batch, size, seed, f"{tmp}/run")
        except Exception as exc:  # noqa: BLE001 - a crash is an outcome; told apart from a misfit below
            try:
                _train(entry, optimizer, 1, batch, size, seed, None)
            except Exception as bare:  # noqa: BLE001
                out.unfit = f"{type(bare).__name__}: {str(bare).splitlines()[0][:200] if str(bare) else ''}"
                return out
            out.crash = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
            return out
    for source, findings in (("record", found), ("diagnose", report.findings)):
        for f in findings:
            if f.severity != "info":
                out.flagged.append((source, f.severity, f.kind, f.name, f.detail[:300]))
    if any(k == "nonfinite_gradient" for _, _, k, _, _ in out.flagged):
        # A NaN is a true finding if the same loop diverges without gradrepro: then the model
        # does not train at this size, batch and learning rate, and is left out as unfit.
        _, _, losses = _train(entry, optimizer, steps, batch, size, seed, None)
        bad = [k for k, v in enumerate(losses) if not math.isfinite(v)]
        if bad:
            out.unfit = f"diverges without gradrepro (loss {losses[bad[0]]} at step {bad[0]})"
    return out


def flagged_share(outcomes: list[Outcome]) -> float:
    judged = [o for o in outcomes if not o.unfit]
    return sum(bool(o.flagged or o.crash) for o in judged) / len(judged) if judged else math.nan

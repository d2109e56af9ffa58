"""Train and evaluate a Long-Short vision model (ViL-LS, CvT*-LS) on an ImageFolder dataset with timm and accelerate.

    accelerate launch -m recipes.imagenet.train --data-dir /data/imagenet --model vil_ls_medium --output-dir runs/m
    python -m recipes.imagenet.train --data-dir /data/imagenet --model vil_ls_medium --pretrained --eval-only

``--data-dir`` holds ``train/<class>/*`` and ``val/<class>/*`` (or ``validation/``). The defaults are the official
ViL-LS-Medium recipe (NVIDIA/transformer-ls ``imagenet/``, paper Sec. 4.3): 300 epochs of AdamW (lr 8e-4 for a global
batch of 1024, weight decay 0.1, none on norms, biases, cls tokens and position tables), a per-step cosine schedule
with 5 linear warm-up epochs from 0.002 x lr (``--warmup-lr``) and then down to 1e-6, label smoothing 0.1, Mixup 0.8 /
CutMix 1.0, RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25 and drop path 0.3 (with fp16 autocast:
``--mixed-precision fp16``).
Every epoch ends with top-1/top-5 on the validation images, a line in ``summary.csv``, the full training state in
``OUTPUT_DIR/last`` (a rerun resumes from it) and, when top-1 improves, the weights (EMA ones with ``--model-ema``) in
``OUTPUT_DIR/best``, loadable with ``timm.create_model("local-dir:OUTPUT_DIR/best", pretrained=True)``.
"""

import argparse
import json
import pickle
from pathlib import Path

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_model, save_model
from timm.data import Mixup, create_dataset, create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import save_for_hf
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import AverageMeter, ModelEmaV3, ParseKwargs, accuracy, update_summary
from torch.utils.data import DataLoader

import ls_timm  # noqa: F401  (registers the vil_ls_* and cvt_ls_* models)
from ls_timm.hierarchical import HierarchicalTransformer
from ls_timm.long_short_attention_2d import LongShortAttention2d
from recipes.memory import AttentionLayer, TrainingStep, check_memory

EVAL_SPLITS = ("val", "validation")
WARMUP_FACTOR = 0.002  # official SOLVER.WARMUP_FACTOR: warm-up starts from 0.002 x the peak learning rate
EMA_FILE = "ema.safetensors"  # in OUTPUT_DIR/last


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.imagenet.train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--data-dir", required=True, help="ImageFolder root with train/ and val/ (or validation/) class folders.")
    add("--output-dir", default="output/train", help="Where the state, best weights and summary.csv go.")
    add("--model", default="vil_ls_medium", help="timm model name (e.g. vil_ls_medium, cvt_ls_13) or local-dir:PATH.")
    add("--model-kwargs", nargs="*", default={}, action=ParseKwargs, help="Extra model arguments, e.g. depths=(1,1,2).")
    add("--pretrained", action="store_true", help="Start from the model's registered weights (downloaded by timm).")
    add(
        "--pretrained-file",
        help="Start from a local checkpoint (timm or official format, converted by the model); "
        "a classifier for other classes is replaced by a new one to fine-tune.",
    )
    add(
        "--img-size",
        type=int,
        help="Training and evaluation image side (CvT-LS picks r and w from it); default: the "
        "model's own, e.g. 384 for vil_ls_medium_384.",
    )
    add("--eval-only", action="store_true", help="Only evaluate the (pretrained) model on the validation images.")
    add("--epochs", type=int, default=300, help="Training epochs (official: 300).")
    add("--batch-size", type=int, default=128, help="Images per process and step (official: 8 GPUs x 128).")
    add("--lr", type=float, default=8e-4, help="Peak learning rate (official: 8e-4 for ViL-LS, 5e-4 for CvT-LS).")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay.")
    add("--opt", default="adamw", help="timm optimizer name.")
    add("--opt-eps", type=float, default=1e-8, help="Optimizer epsilon.")
    add("--clip-grad", type=float, help="Gradient norm clipping (off in the official recipe).")
    add("--warmup-epochs", type=int, default=5, help="Linear warm-up, then cosine decay (updated every step).")
    add("--warmup-lr", type=float, help=f"Learning rate at the start of warm-up; default: {WARMUP_FACTOR} x --lr.")
    add("--min-lr", type=float, default=1e-6, help="Learning rate at the end of the cosine decay.")
    add("--drop-path", type=float, default=0.3, help="Stochastic depth (official: 0.3 Medium, 0.5 Base, 0.2 at 384).")
    add("--smoothing", type=float, default=0.1, help="Label smoothing.")
    add("--mixup", type=float, default=0.8, help="Mixup alpha (0 turns it off).")
    add("--cutmix", type=float, default=1.0, help="CutMix alpha (0 turns it off).")
    add("--mixup-prob", type=float, default=1.0, help="Probability of applying Mixup or CutMix to a batch.")
    add("--mixup-switch-prob", type=float, default=0.5, help="Probability of CutMix instead of Mixup.")
    add("--aa", default="rand-m9-mstd0.5-inc1", help="timm auto-augment policy ('none' turns it off).")
    add("--reprob", type=float, default=0.25, help="Random erasing probability.")
    add("--model-ema", action="store_true", help="Keep an EMA of the weights; it is evaluated and exported as best.")
    add("--model-ema-decay", type=float, default=0.99996, help="EMA decay per step (with --model-ema).")
    add(
        "--mixed-precision",
        choices=("no", "fp16", "bf16"),
        help="Autocast precision; default: accelerate's config (the official runs used fp16 AMP).",
    )
    add(
        "--use-cpu",
        action="store_true",
        help="Run on the CPU even with a GPU; needed for multi-process CPU launches "
        "(accelerate launch --config_file recipes/accelerate/cpu.yaml).",
    )
    add("--workers", type=int, default=8, help="Data loading processes per training process.")
    add("--seed", type=int, default=42, help="Random seed (weights, data order, augmentation).")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Path]:
    """Exit with a message naming the argument when it cannot work; return the split folders."""
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        parser.error(f"--data-dir {args.data_dir!r}: no such folder; pass an ImageFolder root holding train/ and val/.")
    splits = {"train": data_dir / "train"} if not args.eval_only else {}
    splits["val"] = next((data_dir / s for s in EVAL_SPLITS if (data_dir / s).is_dir()), data_dir / EVAL_SPLITS[0])
    for name, folder in splits.items():
        if not folder.is_dir() or not any(p.is_dir() for p in folder.iterdir()):
            parser.error(
                f"--data-dir {args.data_dir!r}: {folder} is missing or has no class folders; lay the images "
                f"out as {folder}/<class>/<image>."
            )
    if ":" not in args.model and not timm.is_model(args.model):
        parser.error(
            f"--model {args.model!r}: unknown; pick a registered model, e.g. one of "
            f"{', '.join(timm.list_models('*_ls_*'))}."
        )
    if args.pretrained and args.pretrained_file:
        parser.error("--pretrained and --pretrained-file both pick start weights; pass one of them.")
    if args.pretrained_file and not Path(args.pretrained_file).is_file():
        parser.error(f"--pretrained-file {args.pretrained_file!r}: no such file.")
    if args.pretrained_file and ":" in args.model:
        parser.error(
            f"--pretrained-file loads into a registered --model; {args.model!r} brings its own weights: pass "
            f"--pretrained instead."
        )
    if args.pretrained_file:
        try:
            checkpoint_classes(args.pretrained_file, timm.models.get_pretrained_cfg_value(args.model, "classifier"))
        except (KeyError, RuntimeError, ValueError, pickle.UnpicklingError) as err:  # torch.load of a non-checkpoint
            parser.error(
                f"--pretrained-file {args.pretrained_file!r} holds no weights that can be read "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); pass a timm or official "
                f"checkpoint (.pth, .safetensors) of --model {args.model}."
            )
    for name in ("epochs", "batch_size", "img_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size % 2:
        parser.error(f"--batch-size {args.batch_size}: Mixup/CutMix mix pairs of images, so it must be even.")
    return splits


def checkpoint_classes(path: str, classifier: str) -> int:
    """Outputs of the ``classifier`` layer in a checkpoint file, timm or official format (a ``net`` state dict with
    ``module.`` prefixes); 0 without one."""
    state = timm.models.load_state_dict(path)
    weight = timm.models.clean_state_dict(state.get("net", state)).get(f"{classifier}.weight")
    return 0 if weight is None else len(weight)


def create_model(
    parser: argparse.ArgumentParser, args: argparse.Namespace, num_classes: int, log=print
) -> torch.nn.Module:
    """The timm model for ``num_classes`` classes, with the start weights asked for.

    Start weights whose classifier has ``num_classes`` outputs are loaded whole. Weights trained on other classes
    (ImageNet-1k ones for another dataset) start a fine-tuning: timm drops their classifier and the model gets a new
    one, as ``timm.create_model(name, pretrained=True, num_classes=...)`` does; --eval-only refuses to score that one.
    """
    kwargs = {"num_classes": num_classes, "drop_path_rate": args.drop_path, **args.model_kwargs}
    if args.img_size is not None:
        kwargs["img_size"] = args.img_size
    overlay = None
    if args.pretrained_file:  # timm loads the file's classifier when the overlay says it has the model's classes
        classifier = timm.models.get_pretrained_cfg_value(args.model, "classifier")
        overlay = {"file": args.pretrained_file, "num_classes": checkpoint_classes(args.pretrained_file, classifier)}
    try:
        model = timm.create_model(
            args.model, pretrained=args.pretrained or overlay is not None, pretrained_cfg_overlay=overlay, **kwargs
        )
    except (ValueError, TypeError, RuntimeError) as err:  # RuntimeError: start weights that do not fit the model
        parser.error(f"--model {args.model} with {kwargs}: {err}")
    start_classes = model.pretrained_cfg["num_classes"]
    if (args.pretrained or args.pretrained_file) and start_classes != num_classes:
        start = f"--pretrained-file {args.pretrained_file!r}" if args.pretrained_file else f"--pretrained {args.model}"
        mismatch = f"{start} classifies {start_classes} classes, but --data-dir {args.data_dir!r} holds {num_classes}"
        if args.eval_only:
            parser.error(
                f"{mismatch}; --eval-only would score a new, untrained classifier. Evaluate on data with the "
                f"weights' classes, or train (no --eval-only) to fine-tune them."
            )
        log(f"{mismatch}: fine-tuning with a new classifier.")
    return model


def attention_layers(model: HierarchicalTransformer, input_size: tuple[int, int, int]) -> tuple[AttentionLayer, ...]:
    """Every block of an ``ls_timm`` model as ``recipes.memory`` estimates it, with the tokens of an image of
    ``input_size`` (each stage's conv embedding sets its map size; its global tokens come on top): a Long-Short
    block's queries share a w x w window tile and see (w + 2e)^2 window keys, r projected rows and the global tokens
    (Sec. 3.2 in 2-D, e = max(w // 2, 1)); a full-attention block's see every token."""
    height, width = input_size[1:]
    layers = []
    for stage in model.stages:
        conv = stage.embed.proj
        height, width = (
            (size + 2 * pad - kernel) // stride + 1
            for size, pad, kernel, stride in zip((height, width), conv.padding, conv.kernel_size, conv.stride)
        )
        tokens = height * width + stage.num_prefix_tokens
        for block in stage.blocks:
            attn = block.attn
            if isinstance(attn, LongShortAttention2d):
                w = attn.window_size
                keys, window = (w + 2 * max(w // 2, 1)) ** 2 + attn.projection_rank + attn.num_prefix_tokens, w * w
            else:
                keys = window = tokens
            layers.append(
                AttentionLayer(
                    tokens,
                    block.norm1.normalized_shape[0],
                    block.mlp.fc1.out_features,
                    attn.num_heads,
                    keys,
                    window,
                    probabilities=getattr(attn, "attn_drop", 0) > 0,
                )
            )
    return tuple(layers)


def check_training_memory(
    parser: argparse.ArgumentParser, model: torch.nn.Module, data_config: dict, args, device: torch.device
) -> None:
    """Exit before training when a step of --batch-size images cannot fit the device's memory (``recipes.memory``),
    naming --batch-size. The estimate describes ``ls_timm``'s models; another timm model is not checked."""
    if not isinstance(model, HierarchicalTransformer):
        return
    layers = attention_layers(model, data_config["input_size"])
    parameters = sum(p.numel() for p in model.parameters())

    def step(batch_size: int, checkpointing: bool, lean: bool) -> TrainingStep:
        return TrainingStep(parameters, layers, batch_size, half_precision=args.mixed_precision in ("fp16", "bf16"))

    settings = {"batch_size": args.batch_size, "checkpointing": False, "lean": False}
    check_memory(step, settings, device, {"batch_size": "--batch-size"}, error=parser.error)


def evaluate(model, loader, accelerator: Accelerator) -> dict[str, float]:
    """Cross-entropy loss, top-1 and top-5 accuracy (%) over the whole loader (all processes)."""
    model.eval()
    loss, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    with torch.inference_mode(), accelerator.autocast():
        for images, targets in loader:
            logits, targets = accelerator.gather_for_metrics((model(images), targets))
            acc1, acc5 = accuracy(logits, targets, topk=(1, 5))
            loss.update(torch.nn.functional.cross_entropy(logits.float(), targets).item(), len(targets))
            top1.update(acc1.item(), len(targets))
            top5.update(acc5.item(), len(targets))
    return {"loss": loss.avg, "top1": top1.avg, "top5": top5.avg}


def train_one_epoch(model, loader, optimizer, scheduler, criterion, mixup, ema, accelerator, epoch, args) -> dict:
    """One pass over ``loader``; the learning rate and the EMA follow every step."""
    model.train()
    losses, steps = AverageMeter(), len(loader)
    for i, (images, targets) in enumerate(loader):
        if mixup is not None:
            images, targets = mixup(images, targets)
        with accelerator.autocast():
            loss = criterion(model(images), targets)
        optimizer.zero_grad()
        accelerator.backward(loss)
        if args.clip_grad is not None:
            accelerator.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        scheduler.step_update(epoch * steps + i + 1)
        if ema is not None:
            ema.update(accelerator.unwrap_model(model), step=epoch * steps + i + 1)
        losses.update(loss.item(), len(images))
    return {"loss": losses.avg}


def main(argv=None) -> dict[str, float]:
    """Run the recipe; return the last validation metrics (``loss``, ``top1``, ``top5``, in %)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    splits = check_args(parser, args)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.use_cpu)
    set_seed(args.seed)

    val_set = create_dataset("", root=str(splits["val"]), split="validation")
    classes = sorted(val_set.reader.class_to_idx, key=val_set.reader.class_to_idx.get)
    model = create_model(parser, args, len(classes), accelerator.print)
    data_config = resolve_data_config({"img_size": args.img_size}, model=model)
    val_set.transform = create_transform(**data_config)
    val_loader = DataLoader(val_set, args.batch_size, num_workers=args.workers)
    if args.eval_only:
        model, val_loader = accelerator.prepare(model, val_loader)
        metrics = evaluate(model, val_loader, accelerator)
        accelerator.print(f"eval {args.model}: " + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return metrics

    train_set = create_dataset("", root=str(splits["train"]), split="train", is_training=True)
    if train_set.reader.class_to_idx != val_set.reader.class_to_idx:
        parser.error(
            f"--data-dir {args.data_dir!r}: {splits['train']} and {splits['val']} hold different class "
            f"folders; both splits need the same classes."
        )
    if len(train_set) < args.batch_size * accelerator.num_processes:
        parser.error(
            f"--batch-size {args.batch_size}: larger than the {len(train_set)} training images per step; lower it."
        )
    check_training_memory(parser, model, data_config, args, accelerator.device)
    train_set.transform = create_transform(
        **data_config,
        is_training=True,
        re_prob=args.reprob,
        re_mode="pixel",
        auto_augment=None if args.aa == "none" else args.aa,
    )
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, drop_last=True, num_workers=args.workers)
    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
            prob=args.mixup_prob,
            switch_prob=args.mixup_switch_prob,
            label_smoothing=args.smoothing,
            num_classes=len(classes),
        )
        criterion = SoftTargetCrossEntropy()
    else:
        criterion = LabelSmoothingCrossEntropy(args.smoothing) if args.smoothing > 0 else torch.nn.CrossEntropyLoss()

    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay, eps=args.opt_eps)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    warmup_lr = WARMUP_FACTOR * args.lr if args.warmup_lr is None else args.warmup_lr
    scheduler, epochs = create_scheduler_v2(
        optimizer,
        sched="cosine",
        num_epochs=args.epochs,
        min_lr=args.min_lr,
        warmup_lr=warmup_lr,
        warmup_epochs=args.warmup_epochs,
        step_on_epochs=False,
        updates_per_epoch=len(train_loader),
    )
    # The scheduler needs no state: it steps on the absolute step. The EMA is saved beside the state as safetensors
    # (accelerate would pickle it, and read it back with torch.load(weights_only=False)).
    ema = ModelEmaV3(accelerator.unwrap_model(model), decay=args.model_ema_decay) if args.model_ema else None

    out = Path(args.output_dir)
    accelerator.print(
        f"training {args.model} on {len(train_set)} images of {len(classes)} classes "
        f"({len(val_set)} for validation) for {epochs} epochs, {accelerator.num_processes} process(es) x "
        f"batch {args.batch_size}, {accelerator.device}; state, summary.csv and the best weights go to "
        f"{out}"
    )
    progress = {"epoch": -1, "best_top1": -1.0, "metrics": {}}
    if (out / "last" / "progress.json").is_file():
        accelerator.load_state(out / "last")
        progress = json.loads((out / "last" / "progress.json").read_text())
        accelerator.print(f"resuming from {out / 'last'} after epoch {progress['epoch']}")
        if ema is not None and (out / "last" / EMA_FILE).is_file():
            load_model(ema.module, out / "last" / EMA_FILE, device=str(accelerator.device))
        elif ema is not None:
            accelerator.print(f"{out / 'last'} holds no EMA ({EMA_FILE}): the EMA starts from the current weights")
    metrics = progress.get("metrics", {})  # a finished run's last metrics, when no epoch is left
    for epoch in range(progress["epoch"] + 1, epochs):
        train_metrics = train_one_epoch(
            model, train_loader, optimizer, scheduler, criterion, mixup, ema, accelerator, epoch, args
        )
        metrics = evaluate(model, val_loader, accelerator)
        if ema is not None:
            metrics.update({f"ema_{k}": v for k, v in evaluate(ema.module, val_loader, accelerator).items()})
        top1 = metrics["ema_top1" if ema is not None else "top1"]
        accelerator.print(
            f"epoch {epoch}: train loss {train_metrics['loss']:.4f}  "
            + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        )
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if top1 > progress["best_top1"]:
                best = ema.module if ema is not None else accelerator.unwrap_model(model)
                save_for_hf(
                    best,
                    out / "best",
                    model_config={"label_names": classes},
                    data_config=data_config,
                    safe_serialization=True,
                )
            update_summary(epoch, train_metrics, metrics, out / "summary.csv", lr=optimizer.param_groups[0]["lr"])
        progress = {"epoch": epoch, "best_top1": max(top1, progress["best_top1"]), "metrics": metrics}
        accelerator.save_state(out / "last")
        if accelerator.is_main_process:
            if ema is not None:
                save_model(ema.module, out / "last" / EMA_FILE)
            (out / "last" / "progress.json").write_text(json.dumps(progress))
    accelerator.end_training()
    accelerator.print(
        f"best top-1 {progress['best_top1']:.3f} %: weights in {out / 'best'} (timm.create_model("
        f"'local-dir:{out / 'best'}', pretrained=True)); last state in {out / 'last'}"
    )
    return metrics


if __name__ == "__main__":
    main()

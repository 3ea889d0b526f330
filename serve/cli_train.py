"""``omnidit train-*`` (retrain an embedded model) and ``omnidit run-episode`` (watch the policy)."""

from __future__ import annotations

from pathlib import Path

from .cli_engine_args import resolve_model


def add_training_commands(sub) -> None:
    """The training commands and run-episode, on the ``omnidit`` sub-command parser."""
    trn = sub.add_parser("train-default", help="retrain the embedded default model (about 10 minutes on 2 cores)")
    trn.add_argument("out_dir", help="folder to write the trained model to")
    trn.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    trn.set_defaults(func=cmd_train_default)

    tl = sub.add_parser("train-lora", help="train the example LoRA on the embedded digits model: rank 8, bold "
                                           "digits (about 2 minutes on 2 cores; byte-reproducible)")
    tl.add_argument("out_dir", help="folder for pytorch_lora_weights.safetensors (diffusers / PEFT format)")
    tl.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tl.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    tl.add_argument("--batch", type=int, default=64, help="images per step (default 64)")
    tl.add_argument("--threads", type=int, default=2,
                    help="torch threads (default 2; the same bytes need the same count)")
    tl.add_argument("--model", default=None, help="base model folder (default: the embedded digits model)")
    tl.set_defaults(func=cmd_train_lora)

    te = sub.add_parser("train-edit", help="retrain the embedded instruction-editing model, digits_edit "
                                           "(Qwen-Image-Edit shape; about 12 minutes on 2 cores; byte-reproducible)")
    te.add_argument("out_dir", help="folder to write the trained model to")
    te.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    te.add_argument("--steps", type=int, default=2400, help="training steps (default 2400)")
    te.add_argument("--batch", type=int, default=48, help="edits per step (default 48)")
    te.add_argument("--sources", type=int, default=1500,
                    help="training digits used, the first of the training split (default 1500: all of it)")
    te.add_argument("--make-it-weight", type=int, default=3,
                    help="weight of 'make it a N' rows against 1 for each transform (default 3)")
    te.add_argument("--drop-prompt", type=float, default=0.1,
                    help="share of rows trained with an empty instruction, for guidance (default 0.1)")
    te.add_argument("--threads", type=int, default=2,
                    help="torch threads (default 2; the same bytes need the same count)")
    te.add_argument("--model", default=None,
                    help="the digits model whose VAE and DiT it starts from (default: the embedded one)")
    te.set_defaults(func=cmd_train_edit)

    tvd = sub.add_parser("train-video-default",
                         help="retrain the embedded video model, moving digits (about 18 minutes on 2 cores)")
    tvd.add_argument("out_dir", help="folder to write the trained model to")
    tvd.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tvd.add_argument("--threads", type=int, default=None,
                     help="torch threads (default: torch's); 1 is much faster on a machine busy with other jobs")
    tvd.set_defaults(func=cmd_train_video_default)
    tts = sub.add_parser("train-tts-default",
                         help="retrain the embedded text-to-speech model and its digit recognizer (espeak-ng data; "
                              "apt-get installs espeak-ng when missing; see README for times)")
    tts.add_argument("out_dir", help="folder to write the trained model to")
    tts.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tts.add_argument("--vae-steps", type=int, default=1000, help="audio VAE training steps (default 1000)")
    tts.add_argument("--vae-minutes", type=float, default=10.0,
                     help="audio VAE time budget: it stops at its steps or this, whichever is first (default 10)")
    tts.add_argument("--talker-steps", type=int, default=700, help="talker training steps (default 700)")
    tts.add_argument("--talker-minutes", type=float, default=30.0,
                     help="talker time budget: it stops at its steps or this, whichever is first (default 30)")
    tts.add_argument("--dit-steps", type=int, default=1000, help="audio DiT training steps (default 1000)")
    tts.add_argument("--dit-minutes", type=float, default=10.0, help="audio DiT time budget (default 10)")
    tts.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    tts.add_argument("--no-recognizer", action="store_true", help="skip the recognizer")
    tts.set_defaults(func=cmd_train_tts)

    tp = sub.add_parser("train-policy", help="retrain the embedded reaching policy (behaviour cloning; "
                                             "about 10-15 minutes on 2 cores)")
    tp.add_argument("out_dir", help="folder to write the trained model to")
    tp.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    tp.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                    help="stop after STEP steps of the joint schedule (after pre-training) and save that snapshot "
                         "(default: run it all)")
    tp.set_defaults(func=cmd_train_policy)

    ep = sub.add_parser("run-episode", help="run the policy on one episode of the reaching task and save a GIF")
    ep.add_argument("model", nargs="?", default=None, help="a policy folder or an embedded policy's name (default: "
                                                          "the embedded reaching policy, reach)")
    ep.add_argument("--seed", type=int, default=0, help="episode seed: target layout and instruction (default 0)")
    ep.add_argument("--gif", default="episode.gif", help="output .gif file, in a folder that exists (default "
                                                         "episode.gif)")
    ep.add_argument("--steps", type=int, default=None, help="denoising steps per chunk (default: the policy's, 10)")
    ep.add_argument("--exec-horizon", type=int, default=8, help="actions executed per chunk before re-planning "
                                                                "(default 8)")
    ep.add_argument("--delay", type=int, default=0, help="simulated inference delay in control steps (default 0)")
    ep.add_argument("--rtc", action="store_true", help="real-time chunking: continue the previous chunk through "
                                                       "the delay")
    ep.set_defaults(func=cmd_run_episode)


def _run_training(module: str, out_dir: str, train_kwargs: dict | None = None, **config) -> int:
    """Train ``dit_core.zoo.<module>`` with its ``TrainConfig(**config)``, logging progress; print the folder."""
    import importlib
    import logging

    trainer = importlib.import_module(f"dit_core.zoo.{module}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(trainer.train(out_dir, trainer.TrainConfig(**config), **(train_kwargs or {})))
    return 0


def cmd_train_default(args) -> int:
    return _run_training("train_digits", args.out_dir, seed=args.seed)


def cmd_train_lora(args) -> int:
    return _run_training("train_digits_lora", args.out_dir, seed=args.seed, steps=args.steps, batch=args.batch,
                         threads=args.threads, model=args.model)


def cmd_train_edit(args) -> int:
    return _run_training("train_digits_edit", args.out_dir, seed=args.seed, steps=args.steps, batch=args.batch,
                         sources=args.sources, make_it_weight=args.make_it_weight,
                         drop_prompt=args.drop_prompt, threads=args.threads, model=args.model)


def cmd_train_video_default(args) -> int:
    return _run_training("train_video", args.out_dir, seed=args.seed, threads=args.threads)


def cmd_train_tts(args) -> int:
    return _run_training("train_tts", args.out_dir, {"recognizer": not args.no_recognizer}, seed=args.seed,
                         vae_steps=args.vae_steps, vae_minutes=args.vae_minutes,
                         talker_steps=args.talker_steps, talker_minutes=args.talker_minutes,
                         dit_steps=args.dit_steps, dit_minutes=args.dit_minutes, threads=args.threads)


def cmd_train_policy(args) -> int:
    return _run_training("train_policy", args.out_dir, seed=args.seed, stop_at=args.stop_at)


def cmd_run_episode(args) -> int:
    from dit_core import Engine
    from dit_core.errors import InvalidParamError
    from dit_core.eval.gif import save_gif
    from dit_core.eval.policy import run_policy
    from dit_core.zoo import default_policy

    gif = Path(args.gif)
    if gif.suffix.lower() != ".gif" or not gif.parent.is_dir():  # before any work, not after it
        raise InvalidParamError("--gif", args.gif, "a .gif file in a folder that exists")
    engine = Engine.from_pretrained(resolve_model(args.model) if args.model else default_policy())
    (episode,) = run_policy(engine, [args.seed], delay=args.delay, rtc=args.rtc, exec_horizon=args.exec_horizon,
                            num_inference_steps=args.steps, record=True)
    outcome = f"success in {episode.steps} steps" if episode.success else f"failed after {episode.steps} steps"
    print(save_gif(episode.frames, args.gif, f"{episode.instruction}: {outcome}"))
    print(f"{episode.instruction!r}: {outcome}")
    return 0

"""The `jaxtune launch` subcommands' arguments and calls: `tpu` (tpu.py), `gke` and `xpk` (gke.py), `slurm`
(slurm.py). Each call imports its module when it runs, so `jaxtune --help` loads no JAX."""

from __future__ import annotations

from pathlib import Path


def cmd_launch(args) -> int:
    from jaxtune.launch.tpu import TpuTarget, launch_tpu

    rest = args.rest
    target = TpuTarget(args.name, args.zone, args.accelerator, args.project, args.spot, args.queued)
    return launch_tpu(target, rest, dry_run=args.dry_run, max_restarts=args.max_restarts,
                      compile_first=not args.no_compile_check)


def cmd_launch_gke(args) -> int:
    from jaxtune.launch.gke import SliceJob, launch_gke, launch_xpk

    job = SliceJob(name=args.name, tpu=args.tpu, slices=args.slices, max_restarts=args.max_restarts)
    if args.platform == "xpk":
        return launch_xpk(job, args.image, args.cluster, args.rest, script_dir=Path(args.out or f"{args.name}-xpk"),
                          project=args.project, zone=args.zone, apply=args.apply,
                          compile_first=not args.no_compile_check)
    return launch_gke(job, args.image, args.rest, yaml_path=Path(args.out or f"{args.name}.yaml"), apply=args.apply,
                      compile_first=not args.no_compile_check, poll_seconds=args.poll_seconds)


def cmd_launch_slurm(args) -> int:
    from jaxtune.launch.slurm import SlurmJob, launch_slurm

    job = SlurmJob(name=args.name, nodes=args.nodes, gpus_per_node=args.gpus_per_node, partition=args.partition,
                   account=args.account, time_limit=args.time)
    return launch_slurm(job, args.rest, script_path=Path(args.out or f"{args.name}.sbatch"), submit=args.submit)


def add_cluster_launchers(platforms) -> None:
    """`launch gke`, `launch xpk` (gke.py) and `launch slurm` (slurm.py)."""
    for name, text in (("gke", "a JobSet on N slices of a TPU type in a GKE cluster (written; --apply: kubectl)"),
                       ("xpk", "the same run as `xpk workload create` (printed; --apply: run it)")):
        p = platforms.add_parser(name, help=text, usage=f"jaxtune launch {name} --name N --tpu TYPE [--slices S] "
                                 f"--image IMAGE{' --cluster C' if name == 'xpk' else ''} [--apply] -- train "
                                 "CONFIG.toml [--set k=v ...]")
        p.add_argument("--name", required=True, help="the JobSet's (or xpk workload's) name")
        p.add_argument("--tpu", required=True, help="one slice's TPU type, e.g. v5p-64, v6e-16, v5e-8")
        p.add_argument("--slices", type=int, default=1, help="slices, data parallel over DCN ([mesh] slices)")
        p.add_argument("--image", required=True, help="a container image with jaxtune and jax[tpu] installed")
        p.add_argument("--max-restarts", type=int, default=5, help="restarts after preemptions (JobSet "
                       "failurePolicy.maxRestarts); each resumes from the latest checkpoint")
        p.add_argument("--out", help="the YAML written (gke; default NAME.yaml) or the script directory xpk layers "
                       "on the image (xpk; default NAME-xpk)")
        p.add_argument("--apply", action="store_true", help="kubectl apply and follow it to the end (gke); run "
                       "xpk (xpk)")
        p.add_argument("--no-compile-check", action="store_true", help="skip compiling the step for the slices first")
        if name == "xpk":
            p.add_argument("--cluster", required=True, help="the GKE cluster xpk created")
            p.add_argument("--project", help="Google Cloud project (default: gcloud's)")
            p.add_argument("--zone", help="the cluster's zone (default: gcloud's)")
        else:
            p.add_argument("--poll-seconds", type=float, default=30.0, help="--apply: seconds between status checks")
        p.set_defaults(run=cmd_launch_gke)
    slurm = platforms.add_parser("slurm", help="an sbatch script for a Slurm GPU cluster (written; --submit: sbatch)",
                                 usage="jaxtune launch slurm --name N --nodes N --gpus-per-node G [--partition P] "
                                       "[--time T] [--submit] -- train CONFIG.toml [--set k=v ...]")
    slurm.add_argument("--name", required=True, help="the job's name")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="GPUs a node (one process each)")
    slurm.add_argument("--partition", default="", help="sbatch --partition (default: the cluster's)")
    slurm.add_argument("--account", default="", help="sbatch --account")
    slurm.add_argument("--time", default="", help="sbatch --time, e.g. 24:00:00")
    slurm.add_argument("--out", help="the script written (default NAME.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="sbatch the script")
    slurm.set_defaults(run=cmd_launch_slurm)


def add_launch_parsers(sub) -> None:
    """`jaxtune launch {tpu,gke,xpk,slurm}` on the CLI's subcommands `sub`."""
    launcher = sub.add_parser("launch", help="run `jaxtune train` on a Cloud TPU VM (gcloud), GKE TPU slices (a "
                              "JobSet, or xpk) or a Slurm GPU cluster (sbatch)")
    platforms = launcher.add_subparsers(dest="platform", required=True, metavar="{tpu,gke,xpk,slurm}",
                                        help="where: a Cloud TPU VM, GKE (JobSet), xpk, Slurm")
    launch = platforms.add_parser("tpu", help="a Cloud TPU VM through gcloud",
                                  usage="jaxtune launch tpu --name N --zone Z --accelerator TYPE [--project P] "
                                        "[--spot] [--queued] [--dry-run] [--no-compile-check] -- train CONFIG.toml "
                                        "[--set k=v ...]")
    launch.add_argument("--name", required=True, help="TPU VM (or queued resource) name")
    launch.add_argument("--zone", required=True, help="the TPU VM's zone, e.g. us-central2-b")
    launch.add_argument("--accelerator", required=True, help="e.g. v5e-8, v5p-32, v6e-16, v4-8")
    launch.add_argument("--project", help="Google Cloud project (default: gcloud's configured one)")
    launch.add_argument("--spot", action="store_true", help="spot capacity; needs train.output_dir on gs://")
    launch.add_argument("--queued", action="store_true", help="create through a queued resource")
    launch.add_argument("--max-restarts", type=int, default=5, help="re-creations after preemption")
    launch.add_argument("--dry-run", action="store_true", help="print every gcloud command, run none (the compile "
                        "check still runs and says its verdict)")
    launch.add_argument("--no-compile-check", action="store_true", help="launch without first compiling the run's "
                        "step for the slice with the TPU compiler (which needs libtpu and the model's config here)")
    launch.set_defaults(run=cmd_launch)
    add_cluster_launchers(platforms)

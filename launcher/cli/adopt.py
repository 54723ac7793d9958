"""`fractus-pod adopt`: take over a reference-trainer run directory (launcher/pod/setup_adopt.py)."""

from __future__ import annotations

import click

from launcher.cli.options import pod_dir_of, pod_dir_option
from launcher.pod.setup_adopt import adopt_run, table


@click.command()
@pod_dir_option
@click.option("--devices", default=None,
              help="GPUs to adopt, e.g. cuda:0-7 or cpu:2 (default: every GPU the manifests "
                   "list, on CUDA).")
@click.option("--model", default=None, metavar="PRESET|FILE",
              help="The model config (default: the checkpoints'; a bare state_dict: 1b).")
@click.option("--init-new-from", "init_new_from", default=None, metavar="PATH",
              help="Checkpoint a GPU no manifest lists starts from, at token 0 of its shard "
                   "(e.g. checkpoints/FRACTUS_1B_STAGE2_MERGED.pt).")
@click.option("--manifest", default=None, metavar="PATH",
              help="Adopt this manifest only (default: every RESUME_MANIFEST* the run has).")
@click.pass_context
def adopt(ctx, devices, model, init_new_from, manifest) -> None:
    """Take over this run directory unchanged: find its manifests, checkpoints and shards,
    hash them, write fractus-pod.yaml naming them, keep the originals as the adoption
    baseline. Exit 2, one line per problem and nothing written, if a GPU cannot resume."""
    pod_dir = pod_dir_of(ctx)
    adoption = adopt_run(pod_dir, devices, model, init_new_from, manifest)
    for line in table(adoption):
        click.echo(line)
    for g in adoption.gpus:
        if g.filled:
            click.echo(f"gpu {g.gpu}: {g.checkpoint}: {g.filled}")
    click.echo(f"adopted {len(adoption.gpus)} GPU(s): fractus-pod.yaml names these files; "
               f"manifest {adoption.manifest.path.relative_to(pod_dir)}; originals kept "
               f"under checkpoints/adopted/")
    stage = adoption.manifest.recorded_stage()
    click.echo(f"next: fractus-pod --pod-dir {pod_dir} launch"
               + (f" (resumes at stage {stage}, the stage the manifest records)" if stage
                  else " --stage 1"))
    click.echo(f"then: fractus-pod --pod-dir {pod_dir} data push --to "
               f"hf://datasets/OWNER/REPO puts the shards on the hub once, so a pod rebuilt "
               f"with `launch --from-hub` fetches them")

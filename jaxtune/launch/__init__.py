"""Launching `jaxtune train` where the accelerators are: a Cloud TPU VM through gcloud (tpu.py), N slices of a TPU
type in a GKE cluster as a JobSet or an xpk workload (gke.py), a Slurm GPU cluster (slurm.py); the CLI's side in
command.py.
"""

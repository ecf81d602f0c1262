"""`meshrun submit`: one job description (job.py), written out for a cluster's scheduler
(slurm.py: an sbatch script; kubernetes.py: a Kubeflow TrainJob or a JobSet), or run on a Ray
cluster by Ray Train (ray.py)."""

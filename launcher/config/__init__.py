"""the files a person writes: fractus-pod.yaml, stages, YAML reading."""

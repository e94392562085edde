"""Running on Ray: cluster configs, metric definitions, dashboards and autoscaling policy."""

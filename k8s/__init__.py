"""Kubernetes deployment of the SpecDecode service through KubeRay's RayService.

`k8s.generate` builds the committed manifests (`k8s/rayservice-*.yaml`) from one base template,
per-variant overlays and `deployments/serve_config.yaml`; see k8s/README.md.
"""

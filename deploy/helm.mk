# Helm chart and image checks; included from the root Makefile (`include deploy/helm.mk`).
#
#   make helm-tools      fetch the pinned helm binary into $(HELM)
#   make helm-lint       helm lint --strict, default, production and GPU values
#   make helm-template   render the three value sets into $(HELM_RENDER_DIR)
#   make helm-validate   kubernetes-validate --strict on the rendered manifests
#   make docker-lint     hadolint on deploy/docker/Dockerfile
#
# tests/deploy (pytest) runs the same lint/render/validate steps plus checks on
# the rendered objects; these targets are for looking at the output by hand.

PY ?= .venv/bin/python
HELM ?= .tools/bin/helm
HADOLINT ?= $(dir $(PY))hadolint

CHART := deploy/helm/specserve
CHART_PRODUCTION_VALUES := $(CHART)/examples/values-production.yaml
CHART_GPU_VALUES := $(CHART)/examples/values-gpu.yaml
HELM_RELEASE ?= specserve
HELM_NAMESPACE ?= specserve
# Oldest Kubernetes the rendered manifests are checked against, and the newest
# schema kubernetes-validate bundles.
HELM_KUBE_VERSION ?= 1.33.0
K8S_VALIDATE_VERSIONS ?= 1.33.0 1.37.0
HELM_RENDER_DIR ?= .tools/rendered

.PHONY: helm-tools helm-lint helm-template helm-validate docker-lint

helm-tools:
	@PY="$(PY)" HELM="$(HELM)" bash deploy/tools/fetch-helm.sh

helm-lint: helm-tools
	$(HELM) lint --strict --kube-version $(HELM_KUBE_VERSION) $(CHART)
	$(HELM) lint --strict --kube-version $(HELM_KUBE_VERSION) $(CHART) -f $(CHART_PRODUCTION_VALUES)
	$(HELM) lint --strict --kube-version $(HELM_KUBE_VERSION) $(CHART) -f $(CHART_GPU_VALUES)

helm-template: helm-tools
	@mkdir -p $(HELM_RENDER_DIR)
	$(HELM) template $(HELM_RELEASE) $(CHART) --namespace $(HELM_NAMESPACE) \
		--kube-version $(HELM_KUBE_VERSION) > $(HELM_RENDER_DIR)/default.yaml
	$(HELM) template $(HELM_RELEASE) $(CHART) --namespace $(HELM_NAMESPACE) \
		--kube-version $(HELM_KUBE_VERSION) -f $(CHART_PRODUCTION_VALUES) > $(HELM_RENDER_DIR)/production.yaml
	$(HELM) template $(HELM_RELEASE) $(CHART) --namespace $(HELM_NAMESPACE) \
		--kube-version $(HELM_KUBE_VERSION) -f $(CHART_GPU_VALUES) > $(HELM_RENDER_DIR)/gpu.yaml
	@echo "rendered into $(HELM_RENDER_DIR)/{default,production,gpu}.yaml"

# CRD kinds (ServiceMonitor, ScaledObject, Certificate) have no bundled schema: kubernetes-validate
# warns about them and passes; tests/deploy checks their structure.
helm-validate: helm-template
	@for version in $(K8S_VALIDATE_VERSIONS); do \
		$(PY) -m kubernetes_validate --strict --quiet -k $$version \
			$(HELM_RENDER_DIR)/default.yaml $(HELM_RENDER_DIR)/production.yaml \
			$(HELM_RENDER_DIR)/gpu.yaml || exit 1; \
	done

docker-lint:
	$(HADOLINT) --config deploy/docker/.hadolint.yaml deploy/docker/Dockerfile

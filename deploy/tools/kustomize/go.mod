module tokenbus.local/tools/kustomize

go 1.26.0

tool sigs.k8s.io/kustomize/kustomize/v5

require sigs.k8s.io/kustomize/kustomize/v5 v5.8.2

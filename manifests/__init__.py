"""ScaledObject manifests: the reader (`manifests.scaledobject`: a manifest or CR body to a `ScalerRecord`) and the
CRD (`manifests.crd`: the CustomResourceDefinition, its status types and the reference page, from the same types).

Each face re-exports its parts; callers import from the faces. Pure: no I/O libraries (the reader's `load_path`
reads files). Imported by the autoscaler, the operator (kube/) and the on-call client (oncall/).
"""

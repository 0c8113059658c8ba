"""The manifest schema: ``manifest.fbs`` and its Python face.

``manifest_generated`` is produced from ``manifest.fbs`` by flatc at build time
(the C++ reader is generated from the same file), so the two cannot drift.
"""

from offgraph_kv.schemas.manifest import (  # noqa: F401
    MANIFEST_VERSION,
    Manifest,
    ManifestError,
    PrivateTensor,
    WeightSpec,
    dtype_from_name,
)

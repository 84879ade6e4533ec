"""Real-world JSON schemas read at test time (test_grammar_parity_cfn_corpus.py): the AWS CloudFormation resource
provider schemas that cfn-lint (PyPI, pure Python) ships in its wheel, under cfnlint/data/schemas/resources/, one
JSON Schema (draft-07 style: `definitions`, `$ref` to "#/definitions/...") per resource type. The wheel of the
pinned version is downloaded with pip into a temporary folder and read as a zip archive (nothing is installed,
nothing of cfn-lint's is kept in Kestrel's repository).

Each resource schema becomes what a user would send as response_format: its JSON-Schema parts (`properties`,
`definitions`, `required`, `additionalProperties`, `oneOf`/`anyOf`/`allOf`, ... at the top; everything inside them
as written), without CloudFormation's own top-level annotations of the resource (typeName, handlers,
primaryIdentifier, readOnlyProperties, createOnlyProperties, writeOnlyProperties, tagging, propertyTransform, ...:
see CFN_TOP_LEVEL), which describe the resource to CloudFormation and are no JSON Schema keywords. The keywords
CloudFormation adds inside property schemas (insertionOrder, relationshipRef, arrayType, ...) are kept: they are
unknown keywords to JSON Schema, which ignores them, as both engines do."""

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CFN_LINT_VERSION = "1.58.0"  # pinned: the corpus (and the test's counts) is this version's schemas
REGION = "us-east-1"  # the schema version of a resource type: the one this region uses, else the first region's

# The top-level keywords of a CloudFormation resource schema that are JSON Schema's (kept); every other top-level
# key is CloudFormation's description of the resource (dropped).
JSON_SCHEMA_TOP_LEVEL = {"$schema", "$id", "$comment", "title", "description", "type", "properties", "definitions",
                         "$defs", "required", "additionalProperties", "patternProperties", "oneOf", "anyOf",
                         "allOf", "not", "if", "then", "else", "dependencies", "dependentRequired",
                         "dependentSchemas", "minProperties", "maxProperties", "propertyNames", "enum", "const"}
# The ones found in the pinned version (for the test's docstring and report; anything else is dropped too).
CFN_TOP_LEVEL = ("typeName", "handlers", "primaryIdentifier", "additionalIdentifiers", "readOnlyProperties",
                 "createOnlyProperties", "writeOnlyProperties", "conditionalCreateOnlyProperties",
                 "deprecatedProperties", "tagging", "taggable", "propertyTransform", "replacementStrategy",
                 "lifecycle", "sourceUrl", "documentationUrl", "resourceLink", "typeConfiguration", "requiredXor",
                 "requiredOr", "dependentExcluded")


def download_wheel(dest):
    """The pinned cfn-lint wheel, with pip (no dependencies, no install). Returns its path; raises with pip's
    output."""
    cmd = [sys.executable, "-m", "pip", "download", f"cfn-lint=={CFN_LINT_VERSION}", "--no-deps", "--only-binary",
           ":all:", "-q", "--disable-pip-version-check", "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = sorted(Path(dest).glob(f"cfn_lint-{CFN_LINT_VERSION}-*.whl"))
    if r.returncode != 0 or not wheels:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return wheels[0]


def resource_schemas(wheel):
    """{resource type name: its schema as written} from the wheel: per type, the version REGION uses, else the
    one of the first region (in name order) that has the type."""
    with zipfile.ZipFile(wheel) as z:
        base = "cfnlint/data/schemas/"
        regions = sorted(n[len(base + "providers/"):-len(".json")] for n in z.namelist()
                         if n.startswith(base + "providers/") and n.endswith(".json"))
        assert REGION in regions, regions
        chosen = {}
        for region in [REGION] + [r for r in regions if r != REGION]:
            for type_name, digest in json.loads(z.read(f"{base}providers/{region}.json")).items():
                chosen.setdefault(type_name, digest)
        return {t: json.loads(z.read(f"{base}resources/{d}.json")) for t, d in sorted(chosen.items())}


def fetch_schemas():
    cached = os.environ.get("KESTREL_CFN_LINT_WHEEL")  # a downloaded wheel, to skip the download when iterating
    if cached:
        return resource_schemas(cached)
    with tempfile.TemporaryDirectory() as tmp:
        return resource_schemas(download_wheel(tmp))


def as_response_format(resource):
    """The schema a user would send: the JSON-Schema keywords of the top level (JSON_SCHEMA_TOP_LEVEL), the rest
    (CloudFormation's annotations of the resource) dropped."""
    return {k: v for k, v in resource.items() if k in JSON_SCHEMA_TOP_LEVEL}

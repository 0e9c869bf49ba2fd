"""vlm-caption: caption, tag or OCR media in object storage with vision-language models on vLLM,
orchestrated by Prefect.

The one import namespace: `vlm_caption.flows`, `vlm_caption.tasks`, `vlm_caption.recipes`,
`vlm_caption.deployments` and `vlm_caption.bench`. The wheel puts those packages inside this one
(pyproject.toml). A checkout keeps them as the repository's top-level folders, so there this
package's path is the repository's root. Importing it changes no setting."""
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "flows").is_dir():  # a checkout (an editable install): the packages sit beside this folder
    __path__.append(str(_HERE.parent))

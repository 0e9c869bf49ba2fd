"""A job manifest: JSON Lines, one work item per line (README.md, "Manifest"): media as s3:// URIs,
http(s) URLs, absolute paths or keys relative to its folder. A malformed line stops the job, named."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.reader import SourceReader
from vlm_caption.tasks.sources.storage import StorageError, split_parent


class ManifestLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(..., min_length=1)
    media: list[str] = Field(..., min_length=1)
    question: str | None = Field(None, min_length=1)
    questions: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_list_of_questions(self) -> ManifestLine:
        if self.question is not None:
            self.questions = [self.question, *self.questions]
        if any(not q.strip() for q in self.questions):
            raise ValueError("questions must not be empty")
        return self


class ManifestReader(SourceReader):
    """`--manifest FILE`: one item per line; its storage is the manifest's folder."""

    name = "manifest"
    groups = True
    selectable = False
    checking = "looking for the manifest"
    kind = "manifest"  # what the file is, in messages

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        return SourceSpec(location, modality, format=cls.name, glob=glob, items_root=split_parent(location)[0])

    @property
    def file_name(self) -> str:
        return split_parent(self.spec.uri)[1]

    def check(self) -> SourceSpec:
        if not self.storage.exists(self.file_name):
            raise StorageError(f"{self.spec.uri}: {self.kind} not found")
        return self.spec

    def text(self) -> str:
        try:
            return self.storage.read(self.file_name).decode("utf-8")
        except FileNotFoundError as exc:
            raise StorageError(f"{self.spec.uri}: {self.kind} not found") from exc

    def items(self) -> Iterator[WorkItem]:
        seen: set[str] = set()
        for number, line in enumerate(self.text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                parsed = ManifestLine.model_validate_json(line)
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in exc.errors())
                raise StorageError(f"{self.spec.uri} line {number}: {problems}. Each line is "
                                   '{"id": "...", "media": ["..."], "question": "..."}') from None
            if parsed.id in seen:
                raise StorageError(f"{self.spec.uri} line {number}: id {parsed.id!r} appears twice; ids name results")
            seen.add(parsed.id)
            yield WorkItem(parsed.id, tuple(ObjectRef(m) for m in parsed.media), tuple(parsed.questions))

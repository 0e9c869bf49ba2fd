"""What a run's gallery page shows a person, read from its HTML (the items, their pictures)."""

from __future__ import annotations

from html.parser import HTMLParser


def gallery_items(page: str) -> dict[str, str]:
    """Each item on the page: its key -> what stands for its picture (`thumb`, `strip` or the
    placeholder's text)."""

    class Items(HTMLParser):
        def __init__(self):
            super().__init__()
            self.items: dict[str, str] = {}
            self.current: str | None = None
            self.in_placeholder = False

        def handle_starttag(self, tag, attrs):
            classes = (dict(attrs).get("class") or "").split()
            if tag == "div" and "item" in classes:
                self.current = dict(attrs)["data-key"]
                self.items[self.current] = ""
            elif self.current and not self.items[self.current]:
                if tag == "img" and "thumb" in classes:
                    self.items[self.current] = "thumb"
                elif "strip" in classes:
                    self.items[self.current] = "strip"
                elif "placeholder" in classes:
                    self.in_placeholder = True

        def handle_data(self, data):
            if self.in_placeholder and self.current:
                self.items[self.current] = f"placeholder: {data.strip()}"
                self.in_placeholder = False

    parser = Items()
    parser.feed(page)
    return parser.items

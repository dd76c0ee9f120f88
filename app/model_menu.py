"""The window's File menu: Open model… (a Hugging Face folder or a .gguf file), the recently
opened models, and the embedded default; each shows the model's facts first
(app.open_model_dialog) and loads it only when the user says so."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QFileDialog, QMenu, QMessageBox

from kvscope.app import model_settings
from kvscope.app.model_file import ModelFileError, read_model
from kvscope.app.open_model_dialog import OpenModelDialog

GGUF_FILTER = "GGUF model (*.gguf);;Hugging Face config (config.json);;All files (*)"


class FileMenu:
    """Builds the menu on the window and runs its actions (window.models switches)."""

    def __init__(self, window) -> None:
        self.window = window
        bar = window.menuBar()
        first = bar.actions()[0] if bar.actions() else None
        self.menu = QMenu("&File", window)
        bar.insertMenu(first, self.menu) if first is not None else bar.addMenu(self.menu)
        self.open_action = QAction("&Open model…", window)
        self.open_action.setShortcut(QKeySequence.StandardKey.Open)
        self.open_action.setStatusTip("a Hugging Face model folder or a .gguf file: see what "
                                      "it is and what fits before loading it")
        self.open_action.triggered.connect(self.browse)
        self.folder_action = QAction("Open model &folder…", window)
        self.folder_action.triggered.connect(self.browse_folder)
        self.recent_menu = QMenu("&Recent models", window)
        self.recent_menu.aboutToShow.connect(self.fill_recent)
        self.default_action = QAction("&Embedded model (SmolLM2-135M)", window)
        self.default_action.triggered.connect(self.open_default)
        for item in (self.open_action, self.folder_action):
            self.menu.addAction(item)
        self.menu.addMenu(self.recent_menu)
        self.menu.addAction(self.default_action)
        self.fill_recent()
        self.last_dialog: OpenModelDialog | None = None

    def fill_recent(self) -> None:
        self.recent_menu.clear()
        recent = model_settings.recent_models(self.window.settings)
        for path in recent:
            action = self.recent_menu.addAction(f"{Path(path).name}  —  {path}")
            action.triggered.connect(lambda _checked=False, p=path: self.open_model(p))
        if not recent:
            self.recent_menu.addAction("(none yet)").setEnabled(False)

    def browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.window, "Open model", str(Path.home()),
                                              GGUF_FILTER)
        if path:
            self.open_model(path)

    def browse_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self.window, "Open a Hugging Face model folder",
                                                str(Path.home()))
        if path:
            self.open_model(path)

    def open_default(self) -> None:
        if self.window.engine is None:
            self._say_attached()
            return
        self.window.models.switch_to_default()

    def _say_attached(self) -> None:
        QMessageBox.information(self.window, "Open model",
                                "This window is attached to a running kvscope serve: an "
                                "attached server's model is chosen where it runs.")

    def dialog_for(self, path: str) -> OpenModelDialog | None:
        """The facts dialog for a path (None, with a message box, when it is no model)."""
        try:
            facts = read_model(path)
        except (ModelFileError, OSError) as exc:
            QMessageBox.warning(self.window, "Open model", str(exc))
            return None
        models = self.window.models
        carry = None if models.attached else models.plan(facts)
        return OpenModelDialog(facts, models.budget(), carry, attached=models.attached,
                               parent=self.window)

    def open_model(self, path: str) -> None:
        dialog = self.dialog_for(path)
        if dialog is None:
            return
        self.last_dialog = dialog
        if dialog.exec() == OpenModelDialog.DialogCode.Accepted and not self.window.models.attached:
            self.window.models.switch_to(dialog.facts)

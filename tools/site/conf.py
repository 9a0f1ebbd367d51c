"""Sphinx configuration of the collection's site (built by ``python tools/nbtool.py site``).

nbtool stages the sources (the README as the landing page, copies of the notebooks with their
solutions folded) in a temporary folder and builds them with this folder as the configuration
directory. Nothing is executed: every output on the site is the committed GPU run's. Nothing is
loaded from another host either: no CDN scripts, fonts or badges.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools import nbtool  # noqa: E402

_conf = nbtool.settings()

project = nbtool.site_title()
author = _conf["repository"].split("/")[0]
copyright = author
root_doc = "index"
extensions = ["myst_nb", "sphinx_copybutton"]
# A copy button on every block of code (cells, the README's commands), none on outputs.
copybutton_selector = "div.highlight pre:not(div.cell_output pre)"
exclude_patterns = ["**.ipynb_checkpoints"]

# The notebooks: shown as committed, never run here (CI has no GPU).
nb_execution_mode = "off"
nb_merge_streams = True
# myst-nb would add require.js and the widgets bundle from CDNs; no notebook has widgets.
nb_ipywidgets_js = {}
# The only folded cells are the solutions (nbtool tags them hide-cell in the staged copies).
nb_code_prompt_show = "Show the solution"
nb_code_prompt_hide = "Hide the solution"

myst_heading_anchors = 3  # the README's "#section" links
myst_enable_extensions = ["tasklist"]  # SHEET.md's checklist: "- [ ] rule" as a box to tick
smartquotes = False  # labels such as .to("cpu") must read as in the code and the README

html_theme = "sphinx_book_theme"
html_title = project
html_favicon = "favicon.svg"  # without one, browsers ask for /favicon.ico and log a 404
html_static_path = ["static"]
html_css_files = ["site.css"]
html_js_files = ["site.js"]
# Each page's header: download the notebook (nbtool puts the committed .ipynb where the theme's
# button points, in place of the staged copy) and open it on Colab.
html_copy_source = True
html_show_sourcelink = False
html_theme_options = {
    "repository_url": f"https://github.com/{_conf['repository']}",
    "repository_branch": _conf["branch"],
    "path_to_docs": "",  # the staged notebooks/ lie where the repository's do
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "navbar_persistent": [],  # one search box, in the sidebar (or the header's button on a phone)
}
# Light or dark as the reader's system is set (the figures keep a white ground: site.css).
html_context = {"default_mode": "auto"}


def colab_runs_the_copy_without_outputs(app, pagename, templatename, context, doctree):
    """The header's Colab button opens the notebook's copy without outputs (the run branch), as
    the page's badge does: the theme's would open the committed run, answers and all."""
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []):
            if button.get("text") == "Colab":
                button["url"] = nbtool.run_url(f"{Path(pagename).name}.ipynb", _conf)
                button["tooltip"] = "Run it on Colab (no outputs: predict first)"


def setup(app):
    # after the theme's launch buttons (priority 501)
    app.connect("html-page-context", colab_runs_the_copy_without_outputs, priority=502)

import nbformat as nbf

def build(cells, lang, path):
    """cells: list of ("md", {"en":..., "ja":...}) or ("code", src)."""
    nb = nbf.v4.new_notebook()
    for kind, content in cells:
        if kind == "md":
            nb.cells.append(nbf.v4.new_markdown_cell(content[lang].strip("\n")))
        else:
            nb.cells.append(nbf.v4.new_code_cell(content.strip("\n")))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbf.write(nb, path)

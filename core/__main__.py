from blockforge.cli import entry

entry()

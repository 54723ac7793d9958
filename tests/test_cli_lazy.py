"""The `fractus-pod` group imports a command's module only when that command runs, and its
`--help` lists each command with the command's own short help."""

import json
import subprocess
import sys

import click

from launcher.cli.main import COMMANDS, cli


def test_the_group_lists_each_command_with_its_own_short_help():
    ctx = click.Context(cli)
    for name, (module, text) in COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command.name == name and command.callback.__module__ == module
        assert click.Command(name, help=text).get_short_help_str(1000) == \
            command.get_short_help_str(1000), name
    assert cli.get_command(ctx, "no-such-command") is None


def test_help_imports_no_command_module():
    probe = ("import json, sys\nfrom launcher.cli.main import main\nmain(['--help'])\n"
             "print(json.dumps(sorted(m for m in sys.modules\n"
             "                        if m.startswith(('launcher.', 'torch')))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)
    listed, loaded = done.stdout.strip().rsplit("\n", 1)
    assert all(f"\n  {name} " in listed for name in COMMANDS)
    assert json.loads(loaded) == ["launcher.cli", "launcher.cli.main", "launcher.cli.options",
                                  "launcher.errors", "launcher.paths"]

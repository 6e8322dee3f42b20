"""The stable-first layout: the lines a harness's volatile_text rules match leave the system text for
Conversation.volatile (harness_adapters/layout.py); nothing is added or dropped."""
import json

from harness_adapters import VolatileText, load_registry
from harness_adapters.claude_code import ClaudeCodeAdapter
from harness_adapters.layout import stable_first, volatile_spans
from proxy.conversation import Conversation, Message, TextPart
from tests.proxy.fake_render import user

MEMORY = ("# Memory\n\nYou have a persistent file-based memory at `/home/u/.claude/projects/-home-u-a/memory/`. "
          "Each memory is one file, with frontmatter:\n\n```markdown\nname: <slug>\n```")
ENV = ("You are an agent.\n\n" + MEMORY + "\n\n# Environment\nYou have been invoked in the following environment: \n"
       " - Primary working directory: /home/u/a\n - Is a git repository: true\n"
       " - You are powered by the model named Opus 4.8. The exact model ID is claude-opus-4-8.\n\n"
       "# Tone\nBe brief.\n\ngitStatus: This is the git status.\n\nCurrent branch: main\n\nStatus:\n(clean)")


def conv(system: str) -> Conversation:
    return Conversation((Message("system", (TextPart(system),)), user("fix it")))


def test_claude_code_environment_and_git_status_move_whole():
    out = stable_first(conv(ENV), ClaudeCodeAdapter.rules)
    assert out.messages[0].text == ("You are an agent.\n\n# Memory\n\n```markdown\nname: <slug>\n```\n\n"
                                    "# Tone\nBe brief.")
    assert out.volatile == MEMORY.split("\n")[2] + "\n" + ENV[ENV.index("# Environment"):ENV.index("\n\n# Tone")] + \
        "\n" + ENV[ENV.index("gitStatus"):]
    assert out.messages[1:] == conv(ENV).messages[1:]
    assert sorted((out.messages[0].text + out.volatile).replace("\n", "")) == sorted(ENV.replace("\n", ""))


def test_two_directories_differ_only_in_the_volatile_text():
    a, b = (stable_first(conv(ENV.replace("/home/u/a", d).replace("-home-u-a", d.replace("/", "-"))),
                         ClaudeCodeAdapter.rules) for d in ("/home/u/a", "/srv/b"))
    assert a.messages == b.messages and a.volatile != b.volatile


def test_line_to_end_and_none():
    text = "static one\nDate: 2026-11-29 (today)\nstatic two\nDYNAMIC\nrest one\nrest two"
    assert volatile_spans(text, VolatileText(pattern=r"Date: (\S)")) == [(11, 36)]
    assert volatile_spans(text, VolatileText(pattern=r"\nDYNAMIC", moves="to_end")) == [(47, len(text))]
    rules = (VolatileText(pattern=r"Date: (\S)"), VolatileText(pattern=r"DYNAMIC", moves="to_end"),
             VolatileText(pattern=r"static two", moves="none"))
    out = stable_first(conv(text), rules)
    assert out.messages[0].text == "static one\nstatic two"
    assert out.volatile == "Date: 2026-11-29 (today)\nDYNAMIC\nrest one\nrest two"


def test_idempotent_and_only_the_first_system_message():
    rules = ClaudeCodeAdapter.rules
    once = stable_first(conv(ENV), rules)
    assert stable_first(once, rules) == once
    later = Conversation((user("hi"), Message("system", (TextPart(ENV),))))
    assert stable_first(later, rules) == later
    assert stable_first(conv("no environment here"), rules) == conv("no environment here")


def test_a_user_rules_file_adds_a_harness_with_its_volatile_lines(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"harnesses": [{"name": "my-agent", "system_contains": ["You are my-agent"],
                                               "rules": [{"kind": "volatile_text", "pattern": "^cwd: (\\S)"},
                                                         {"kind": "volatile_text", "pattern": "^## Runtime",
                                                          "moves": "to_end"}]}]}))
    adapter = load_registry(path).detect({}, {}, conv("You are my-agent.\ncwd: /x\nBe brief.\n## Runtime\nv1"))
    assert adapter.name == "my-agent"
    system = "You are my-agent.\ncwd: /x\nBe brief.\n## Runtime\nv1"
    # patterns are plain Python regexes: ^ needs (?m) to match at a line start
    assert stable_first(conv(system), adapter.rules) == conv(system)
    adapter.rules = tuple(VolatileText(pattern="(?m)" + r.pattern, moves=r.moves) for r in adapter.rules)
    out = stable_first(conv(system), adapter.rules)
    assert (out.messages[0].text, out.volatile) == ("You are my-agent.\nBe brief.", "cwd: /x\n## Runtime\nv1")

"""``python -m llmgw`` runs the CLI; the agent uses it to start engines when not frozen."""

from llmgw.cli import main

if __name__ == "__main__":
    main()

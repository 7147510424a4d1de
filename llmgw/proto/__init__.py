"""The Connect protocol between agent and control plane: control.proto and its generated code (`make proto`)."""

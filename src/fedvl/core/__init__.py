"""What methods are made of: messages, the byte ledger, local training, state-dict arithmetic,
SupCon, and DP accounting and DP-SGD. Below the methods and the round driver: nothing here
imports either."""

"""What methods are made of: messages, the byte ledger, local training, state-dict arithmetic
and SupCon. Below the methods and the round driver: nothing here imports either."""

"""The placement policy: the network, rollouts and the REINFORCE update (core), its training loops (train), and
the registered MLflow model that bundles it with its cost model (model). Planners use it through
planners.learned; the train_policy stage (jobs.train_policy) trains and registers it.
"""

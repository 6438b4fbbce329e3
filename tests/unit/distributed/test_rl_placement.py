import pytest

from hpc_rlhf.distributed.placement import make_plan

SIZES = {"actor": 2, "reference": 2, "critic": 1, "reward": 1, "rollout": 3}


def test_separate_roles_get_consecutive_ranks():
    plan = make_plan(SIZES)
    assert [(c.name, list(c.ranks)) for c in plan.components] == [
        ("actor", [0, 1]), ("reference", [2, 3]), ("critic", [4]), ("reward", [5]), ("rollout", [6, 7, 8])]
    assert plan.world_size == 9 and plan.roles_of(7) == ("rollout",)


def test_colocations():
    plan = make_plan(SIZES, colocate_actor_ref=True, colocate_critic_reward=True)
    assert [(c.name, list(c.ranks)) for c in plan.components] == [
        ("actor+reference", [0, 1]), ("critic+reward", [2]), ("rollout", [3, 4, 5])]
    allin = make_plan(SIZES, colocate_all=True)
    assert allin.world_size == 2 and allin.roles_of(1) == ("actor", "reference", "critic", "reward", "rollout")


def test_unused_roles_are_left_out_and_described():
    plan = make_plan({"actor": 1, "reward": 1, "rollout": 1, "critic": 0, "reference": 0})
    assert not plan.has("critic") and plan.ranks_of("reference") == range(0)
    assert "ranks 2-2  world 'rollout'  roles: rollout" in plan.describe()


def test_reward_on_the_actor_ranks():
    plan = make_plan({"actor": 2, "reward": 1, "rollout": 1}, colocate_actor_reward=True)
    assert [(c.name, list(c.ranks)) for c in plan.components] == [("actor+reward", [0, 1]), ("rollout", [2])]
    both = make_plan(SIZES, colocate_actor_ref=True, colocate_actor_reward=True)
    assert both.components[0].roles == ("actor", "reference", "reward")
    with pytest.raises(ValueError, match="either the actor's ranks or the critic's"):
        make_plan(SIZES, colocate_critic_reward=True, colocate_actor_reward=True)

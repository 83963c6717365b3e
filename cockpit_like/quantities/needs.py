"""What the quantities tracked at one step need, as one value.

:meth:`StepNeeds.collect` asks each active quantity once and merges the
answers by value (equal BackPACK extensions, equal per-sample statistics and
equal step needs are one; a need with a ``resolve`` method is met by the need
it names given the step's others, e.g. an estimator that uses the step's
Lanczos space where another quantity computes it);
:class:`~cockpit_like.backends.step.StepExecution` meets the result. Nothing here names a quantity or a backend.
One need is added here rather than asked for: a step at which some quantity uses Hessian-vector products
(``Quantity.hessian_products``) checks the loss's own curvature
(:class:`~cockpit_like.backends.loss_curvature.LossCurvatureCheck`), owned by those quantities.

May import torch, BackPACK, :mod:`cockpit_like.backends` and the quantity
base modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from backpack.extensions import BatchGrad

from cockpit_like.quantities.utils_transforms import merge_transform_hooks, split_transform_hooks

__all__ = ["StepNeeds"]


#: the owner of the extensions the user passed to the cockpit's block (``*exts``) among a step's requests
USER_EXTENSIONS = "the user's *exts"


@dataclass(frozen=True)
class StepNeeds:
    """The merged needs of one step.

    Attributes:
        requests: ``(requested_by, BackPACK extension)`` pairs (the user's ``*exts`` first).
        stats: distinct per-sample statistics.
        hooks: BackPACK extension hooks of quantities (``hook(module)``).
        needs: distinct step needs, computed after the backward pass (``need.compute(execution)``).
        aliases: ``(asked, met_by)`` pairs: a need with a ``resolve(needs)`` method is met by the need of the
            step it names (given all needs asked for at the step), and ``record.stat(asked)`` reads that one's
            result; only ``met_by`` is computed and merged (once, shared by value with whoever else asked for it).
        owners: names of the quantities that asked for per-sample statistics (for messages).
        partial: those of ``owners`` that compute what they can where a step cannot have per-sample statistics
            (``Quantity.works_without_per_sample_stats``).
        need_owners: ``(need, names)`` pairs: the quantities that asked for each of ``needs`` (directly, or for
            a need it meets), so that a need the step cannot meet leaves out exactly them.
        raw_batch_grad: someone asked for BackPACK's ``BatchGrad`` (keep ``grad_batch``).
        create_graph: the backward pass keeps the graph.
        askers: names of the quantities that asked for anything computed in or after the backward pass
            (extensions, extension hooks, per-sample statistics, step needs): the others read only ``p.grad``,
            the parameters, ``info`` and the forward pass.
    """

    requests: tuple = ()
    stats: tuple = ()
    hooks: tuple = ()
    needs: tuple = ()
    aliases: tuple = ()
    owners: tuple = ()
    partial: tuple = ()
    need_owners: tuple = ()
    raw_batch_grad: bool = False
    create_graph: bool = False
    user_types: frozenset = field(default_factory=frozenset)
    askers: frozenset = field(default_factory=frozenset)

    @classmethod
    def collect(
        cls,
        quantities: Iterable[Any],
        step: int,
        name_of: Callable[[Any], str],
        user_exts: tuple = (),
        create_graph: bool = False,
    ) -> StepNeeds:
        """Ask every quantity in ``quantities`` what it needs at ``step``; merge by value."""
        quantities = list(quantities)
        requests = [(USER_EXTENSIONS, ext) for ext in user_exts]
        stats, hooks, needs, owners, transforms, partial = [], [], [], [], [], []
        asked_by: list[tuple[Any, str]] = []
        askers: set[str] = set()
        raw_batch_grad = any(isinstance(ext, BatchGrad) for ext in user_exts)
        for quantity in quantities:
            name = name_of(quantity)
            its_extensions = list(quantity.extensions(step))
            for ext in its_extensions:
                requests.append((name, ext))
                raw_batch_grad |= isinstance(ext, BatchGrad)
            # BatchGradTransformsHooks become one per-sample statistic (utils_transforms)
            other_hooks, its_transforms = split_transform_hooks(quantity.extension_hooks(step))
            hooks.extend(other_hooks)
            transforms.extend(its_transforms)
            asked = quantity.per_sample_stats(step)
            if asked or its_transforms:
                owners.append(name)
                if quantity.works_without_per_sample_stats:
                    partial.append(name)
            stats.extend(s for s in asked if s not in stats)
            its_needs = list(quantity.curvature_needs(step))
            asked_by.extend((n, name) for n in its_needs)
            needs.extend(n for n in its_needs if n not in needs)
            if its_extensions or other_hooks or its_transforms or asked or its_needs:
                askers.add(name)
        # a step with Hessian-vector products checks that they go through the loss's own curvature, where it is
        # known (info['outputs'] of a mean cross-entropy: backends/loss_curvature.py); the quantities that read
        # them own the check (a wrong verdict leaves them out of the step), which no quantity asks for itself
        products = [name_of(quantity) for quantity in quantities if quantity.hessian_products(step)]
        if products:
            from cockpit_like.backends.loss_curvature import LossCurvatureCheck

            asked_by.extend((LossCurvatureCheck(), name) for name in products)
            if LossCurvatureCheck() not in needs:
                needs.append(LossCurvatureCheck())
        if transforms:
            stats.append(merge_transform_hooks(transforms))
        if raw_batch_grad and not stats:
            # BatchGrad() asked for alone: a statistic that reduces nothing, so that the reducer leaves
            # p.grad_batch on every backend (the hooks make it on a model that is not extended)
            from cockpit_like.backends.per_sample_stats import KeepGradBatch

            stats.append(KeepGradBatch())
        asked, needs, aliases = tuple(needs), [], []
        for need in asked:
            met_by = need.resolve(asked) if hasattr(need, "resolve") else need
            if met_by is not need:
                aliases.append((need, met_by))
            if met_by not in needs:
                needs.append(met_by)
        met = dict(aliases)
        need_owners = tuple(
            (need, tuple(dict.fromkeys(name for n, name in asked_by if met.get(n, n) == need))) for need in needs
        )
        return cls(
            requests=tuple(requests),
            stats=tuple(stats),
            hooks=tuple(hooks),
            needs=tuple(needs),
            aliases=tuple(aliases),
            owners=tuple(owners),
            partial=tuple(partial),
            need_owners=need_owners,
            raw_batch_grad=raw_batch_grad,
            create_graph=bool(create_graph),
            user_types=frozenset(type(ext) for ext in user_exts),
            askers=frozenset(askers),
        )

    def partitioned(self) -> StepNeeds:
        """The form each backward pass computes when a step has several (micro-batches, ranks): every
        statistic in the form that merges (:meth:`~cockpit_like.backends.per_sample.PerSampleStat.for_ranks`,
        equal to the requested one)."""
        return replace(self, stats=tuple(stat.for_ranks() for stat in self.stats))

    def __bool__(self) -> bool:
        return bool(self.requests or self.stats or self.hooks or self.needs)

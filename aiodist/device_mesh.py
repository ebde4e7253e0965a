"""n-dimensional meshes of process groups with named dimensions (torch's ``DeviceMesh``).

A mesh lays the world's ranks out as an array, e.g. ``(2, 4)`` for 2-way data parallelism
times 4-way tensor parallelism; each dimension has, for every rank, the group of the ranks
that differ from it only along that dimension. FSDP2 and tensor-parallel code make their
groups this way::

    mesh = await aiodist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    await aiodist.all_reduce(grad, group=mesh["dp"].get_group())
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _api
from .errors import DistUsageError
from .group import ProcessGroup, current_world

__all__ = ["DeviceMesh", "init_device_mesh"]

logger = logging.getLogger(__name__)


class DeviceMesh:
    """This rank's view of a mesh of ranks: the layout, and its group along each dimension.

    Make one with :func:`init_device_mesh`; index it by dimension name (``mesh["tp"]``, or
    several names) for a smaller mesh of this rank's slice.

    Attributes:
        device_type: the device kind the mesh was made for (``"cpu"``, ``"cuda"``).
        mesh: the global rank at each position of the mesh.
        mesh_dim_names: the dimensions' names, or ``None``.
    """

    def __init__(
        self,
        device_type: str,
        mesh: npt.NDArray[np.int64],
        groups: Sequence[ProcessGroup],
        mesh_dim_names: tuple[str, ...] | None,
        rank: int,
    ) -> None:
        self.device_type = device_type
        self.mesh = mesh
        self.mesh_dim_names = mesh_dim_names
        self._groups = list(groups)
        self._rank = rank

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return int(self.mesh.ndim)

    @property
    def shape(self) -> tuple[int, ...]:
        """The number of ranks along each dimension."""
        return tuple(int(n) for n in self.mesh.shape)

    def _dim(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise DistUsageError(f"this mesh has {self.ndim} dimensions: name the one you mean")
            return 0
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise DistUsageError(
                    f"no mesh dimension named {mesh_dim!r}; the mesh has {self.mesh_dim_names}"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if (
            isinstance(mesh_dim, bool)
            or not isinstance(mesh_dim, int)
            or not -self.ndim <= mesh_dim < self.ndim
        ):
            raise DistUsageError(
                f"mesh dimension {mesh_dim!r} is out of range for {self.ndim} dims"
            )
        return mesh_dim % self.ndim

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """Return this rank's group along ``mesh_dim`` (optional for a 1-D mesh).

        Raises:
            DistUsageError: an unknown dimension, or none given for a mesh of several.
        """
        return self._groups[self._dim(mesh_dim)]

    def get_all_groups(self) -> list[ProcessGroup]:
        """Return this rank's group along every dimension, in order."""
        return list(self._groups)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Return the number of ranks along ``mesh_dim``, or in the whole mesh.

        Raises:
            DistUsageError: an unknown dimension.
        """
        if mesh_dim is None:
            return int(self.mesh.size)
        return self.shape[self._dim(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...] | None:
        """Return this rank's position in the mesh (a tuple, as torch's), or ``None`` if it
        is not in it."""
        where = np.argwhere(self.mesh == self._rank)
        return None if not len(where) else tuple(int(i) for i in where[0])

    def get_rank(self) -> int:
        """Return this rank's global rank."""
        return self._rank

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """Return this rank's index along ``mesh_dim`` (its rank in that dimension's group).

        Raises:
            DistUsageError: an unknown dimension, or this rank is not in the mesh.
        """
        coordinate = self.get_coordinate()
        if coordinate is None:
            raise DistUsageError(f"rank {self._rank} is not in {self!r}")
        return coordinate[self._dim(mesh_dim)]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """Return the mesh of this rank's slice along the named dimensions.

        Raises:
            DistUsageError: an unknown or repeated name.
        """
        wanted = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim(n) for n in wanted]
        if len(set(dims)) != len(dims):
            raise DistUsageError(f"mesh dimensions {wanted} repeat a dimension")
        coordinate = self.get_coordinate()
        if coordinate is None:
            raise DistUsageError(f"rank {self._rank} is not in {self!r}")
        index: list[Any] = [slice(None) if d in dims else coordinate[d] for d in range(self.ndim)]
        sub = self.mesh[tuple(index)]
        # The kept dimensions keep their order in the mesh; reorder to the order asked for.
        kept = sorted(dims)
        sub = np.transpose(sub, [kept.index(d) for d in dims]) if len(dims) > 1 else sub
        groups = [self._groups[d] for d in dims]
        return DeviceMesh(self.device_type, sub, groups, wanted, self._rank)


async def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Lay the world's ranks out as a mesh of ``mesh_shape`` and make the group of each line.

    Rank ``r`` sits at position ``r`` of the mesh in row-major order. Every rank must call
    it with the same arguments (it creates ``sum(size / n for n in mesh_shape)`` groups,
    every rank of the world taking part in each).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``: the backend of the mesh's groups.
        mesh_shape: the number of ranks along each dimension; their product is the world size.
        mesh_dim_names: a name for each dimension.

    Returns:
        This rank's :class:`DeviceMesh`.

    Raises:
        DistUsageError: a shape that does not match the world size, names that do not
            match the shape or repeat, or an unknown device type.
    """
    world = current_world("init_device_mesh")
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise DistUsageError(
            f"init_device_mesh: mesh_shape must be positive ints, got {mesh_shape!r}"
        )
    if math.prod(shape) != world.size:
        raise DistUsageError(
            f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape)} ranks but the "
            f"world has {world.size}"
        )
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    if names is not None and (len(names) != len(shape) or len(set(names)) != len(names)):
        raise DistUsageError(
            f"init_device_mesh: mesh_dim_names {names} must name each of the {len(shape)} "
            "dimensions once"
        )
    _api.get_default_backend_for_device(device_type)  # a device kind aiodist serves
    mesh = np.arange(world.size, dtype=np.int64).reshape(shape)
    coordinate = [int(i) for i in np.argwhere(mesh == world.rank)[0]]
    groups: list[ProcessGroup] = []
    for dim in range(len(shape)):
        # Every line along ``dim``, in the same order on every rank.
        others = [range(n) for d, n in enumerate(shape) if d != dim]
        mine: ProcessGroup | None = None
        for fixed in itertools.product(*others):
            index: list[Any] = list(fixed)
            index.insert(dim, slice(None))
            ranks = [int(r) for r in mesh[tuple(index)]]
            group = await _api.new_group(ranks)
            if isinstance(group, ProcessGroup):
                mine = group
        assert mine is not None  # every rank is on one line of each dimension
        groups.append(mine)
    logger.debug("rank %d: device mesh %s at %s", world.rank, shape, coordinate)
    return DeviceMesh(device_type, mesh, groups, names, world.rank)

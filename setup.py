"""ament_python package definition for orin_vlm_node.

Installs what `ros2 run` / `ros2 launch` look for: the ament index marker, package.xml, launch files,
configs and kernel sources under share/orin_vlm_node/, and the `vlm_node` and `vlm_lifecycle_node`
executables under lib/orin_vlm_node/. colcon honours setup.cfg's install_scripts (console scripts there); a
plain `pip install .` ignores setup.cfg for scripts, so the same launchers also ship as data files in
lib/orin_vlm_node/ and both installs end up with one working copy of each there.
"""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "orin_vlm_node"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    package_data={PACKAGE: ["default_model/*"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml")),
        (f"share/{PACKAGE}/kernels", glob("kernels/*.cu") + glob("kernels/*.cuh") + glob("kernels/*.cpp")),
        (f"lib/{PACKAGE}", ["resource/vlm_node", "resource/vlm_lifecycle_node"]),
    ],
    install_requires=["setuptools"],
    zip_safe=False,
    maintainer="orin_vlm_node maintainers",
    maintainer_email="maintainers@orin-vlm-node.dev",
    description="Qwen3-VL vision-language model node for ROS 2 on NVIDIA Jetson Orin",
    license="Apache-2.0",
    python_requires=">=3.10",
    entry_points={
        "console_scripts": [
            f"vlm_node = {PACKAGE}.ros.main:main",
            f"vlm_lifecycle_node = {PACKAGE}.ros.main:main_lifecycle",
        ]
    },
)

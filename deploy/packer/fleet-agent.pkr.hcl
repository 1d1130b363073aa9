# Bakes fleet-agent into an AMI from a GPU base image (NVIDIA driver + CUDA preinstalled).
#
#   python -m build --wheel            # in the repository: dist/fleetd-<version>-py3-none-any.whl
#   packer init deploy/packer && packer build -var wheel=dist/fleetd-0.1.0-py3-none-any.whl deploy/packer
#
# The image gets (deploy/image/provision.sh): a venv at /opt/fleetd/venv with fleetd (agent
# included) and torch, the fleet-agent user, /etc/fleetd/agent.toml (example, overridden at boot),
# the polkit grant for the dead man's switch, and fleet-agent.service enabled. Fleet-specific settings arrive at boot (deploy/cloud-init or fleetd's launch template).

packer {
  required_plugins {
    amazon = {
      source  = "github.com/hashicorp/amazon"
      version = ">= 1.3.0"
    }
  }
}

variable "region" {
  type    = string
  default = "us-east-1"
}

variable "wheel" {
  type        = string
  description = "Path to the fleetd wheel to install (python -m build --wheel)."
}

variable "base_ami_name" {
  type        = string
  description = "Name filter of the GPU base image (AWS Deep Learning Base AMI with NVIDIA driver)."
  # Ubuntu 24.04: Python 3.12. The 22.04 image has 3.10, below fleetd's requires-python (3.11);
  # provision.sh stops with that message on such a base.
  default     = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *"
}

variable "build_instance_type" {
  type        = string
  description = "Instance that runs the build; no GPU is needed to install software."
  default     = "m6i.large"
}

variable "torch_spec" {
  type        = string
  description = "pip requirement for torch (the CUDA build from PyPI): the range pyproject.toml pins, the one the rendezvous-state reader is tested with."
  default     = "torch>=2.11,<2.14"
}

locals {
  stamp = formatdate("YYYYMMDD-hhmm", timestamp())
}

source "amazon-ebs" "fleet_agent" {
  region        = var.region
  instance_type = var.build_instance_type
  ssh_username  = "ubuntu"
  ami_name      = "fleet-agent-${local.stamp}"

  source_ami_filter {
    filters = {
      name                = var.base_ami_name
      architecture        = "x86_64"
      root-device-type    = "ebs"
      virtualization-type = "hvm"
    }
    owners      = ["amazon"]
    most_recent = true
  }

  # The build instance follows the same rule as the nodes: IMDSv2 only.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  tags = {
    Name          = "fleet-agent-${local.stamp}"
    "fleetd:role" = "agent-ami"
  }
}

build {
  sources = ["source.amazon-ebs.fleet_agent"]

  # Everything deploy/image/provision.sh installs, in one folder it reads (FILES).
  provisioner "shell" {
    inline = ["mkdir -p /tmp/fleetd-image"]
  }

  provisioner "file" {
    sources = [
      var.wheel,
      "${path.root}/../../systemd/fleet-agent.service",
      "${path.root}/../examples/agent.toml",
      "${path.root}/../polkit/50-fleet-agent-poweroff.rules",
      "${path.root}/../polkit/50-fleet-agent-poweroff.pkla",
    ]
    destination = "/tmp/fleetd-image/"
  }

  provisioner "file" {
    source      = "${path.root}/../sysusers/fleetd.conf"
    destination = "/tmp/fleetd-image/fleetd-sysusers.conf"
  }

  # A script file with a bash shebang, run as root: Packer runs inline commands with /bin/sh -e
  # (dash), which rejects `set -o pipefail`. tests/test_deploy_image.py runs this same file.
  provisioner "shell" {
    script          = "${path.root}/../image/provision.sh"
    execute_command = "chmod +x {{ .Path }}; sudo -E env {{ .Vars }} {{ .Path }}"
    environment_vars = [
      "FILES=/tmp/fleetd-image",
      "WHEEL=${basename(var.wheel)}",
      "TORCH_SPEC=${var.torch_spec}",
    ]
  }
}

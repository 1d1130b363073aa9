# Bakes fleet-agent into an AMI from a GPU base image (NVIDIA driver + CUDA preinstalled).
#
#   python -m build --wheel            # in the repository: dist/fleetd-<version>-py3-none-any.whl
#   packer init deploy/packer && packer build -var wheel=dist/fleetd-0.1.0-py3-none-any.whl deploy/packer
#
# The image gets: a venv at /opt/fleetd/venv with fleetd (agent included) and torch, the
# fleet-agent user, /etc/fleetd/agent.toml (example, overridden at boot), and fleet-agent.service
# enabled. Fleet-specific settings arrive at boot (deploy/cloud-init or fleetd's launch template).

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
  default     = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
}

variable "build_instance_type" {
  type        = string
  description = "Instance that runs the build; no GPU is needed to install software."
  default     = "m6i.large"
}

variable "torch_spec" {
  type        = string
  description = "pip requirement for torch (the CUDA build from PyPI by default)."
  default     = "torch>=2.3"
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

  provisioner "file" {
    source      = var.wheel
    destination = "/tmp/${basename(var.wheel)}"
  }

  provisioner "file" {
    source      = "${path.root}/../../systemd/fleet-agent.service"
    destination = "/tmp/fleet-agent.service"
  }

  provisioner "file" {
    source      = "${path.root}/../sysusers/fleetd.conf"
    destination = "/tmp/fleetd-sysusers.conf"
  }

  provisioner "file" {
    source      = "${path.root}/../polkit/50-fleet-agent-poweroff.rules"
    destination = "/tmp/50-fleet-agent-poweroff.rules"
  }

  provisioner "file" {
    source      = "${path.root}/../examples/agent.toml"
    destination = "/tmp/agent.toml"
  }

  provisioner "shell" {
    environment_vars = [
      "WHEEL=/tmp/${basename(var.wheel)}",
      "TORCH_SPEC=${var.torch_spec}",
    ]
    inline = [
      "set -euxo pipefail",
      "sudo cloud-init status --wait || true",
      "sudo apt-get update -qq",
      "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv",
      "sudo install -m 0644 /tmp/fleetd-sysusers.conf /usr/lib/sysusers.d/fleetd.conf",
      "sudo systemd-sysusers",
      "sudo python3 -m venv /opt/fleetd/venv",
      "sudo /opt/fleetd/venv/bin/pip install --quiet --upgrade pip",
      "sudo /opt/fleetd/venv/bin/pip install --quiet \"$TORCH_SPEC\"",
      "sudo /opt/fleetd/venv/bin/pip install --quiet \"$WHEEL\"",
      "sudo install -d -m 0750 -o root -g fleet-agent /etc/fleetd /etc/fleetd/mqtt",
      "sudo install -m 0640 -o root -g fleet-agent /tmp/agent.toml /etc/fleetd/agent.toml",
      "sudo install -m 0644 /tmp/fleet-agent.service /etc/systemd/system/fleet-agent.service",
      "sudo install -D -m 0644 /tmp/50-fleet-agent-poweroff.rules /etc/polkit-1/rules.d/50-fleet-agent-poweroff.rules",
      "sudo systemd-analyze verify /etc/systemd/system/fleet-agent.service",
      "sudo systemctl daemon-reload",
      "sudo systemctl enable fleet-agent.service",
      "/opt/fleetd/venv/bin/fleet-agent --version",
      "/opt/fleetd/venv/bin/fleet-agent config check --config /etc/fleetd/agent.toml > /dev/null",
      "sudo rm -f /tmp/*.whl /tmp/fleet-agent.service /tmp/agent.toml /tmp/fleetd-sysusers.conf /tmp/50-fleet-agent-poweroff.rules",
    ]
  }
}

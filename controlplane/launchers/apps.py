from django.apps import AppConfig


class LaunchersConfig(AppConfig):
    name = "controlplane.launchers"
    label = "launchers"

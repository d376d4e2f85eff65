from django.contrib import admin

from controlplane.jobs import models


@admin.register(models.Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "backend", "status", "status_reason", "last_step", "attempt", "created_at")
    list_filter = ("status", "backend")
    search_fields = ("name",)
    readonly_fields = ("token_hash",)


@admin.register(models.Rank)
class RankAdmin(admin.ModelAdmin):
    list_display = ("job", "rank", "node", "phase", "last_step", "last_heartbeat_at", "stale_at", "lost_at")
    list_filter = ("phase",)


@admin.register(models.Event)
class EventAdmin(admin.ModelAdmin):
    list_display = ("job", "event_id", "kind", "rank", "at", "received_at")
    list_filter = ("kind",)
    search_fields = ("event_id",)


@admin.register(models.RestartCycle)
class RestartCycleAdmin(admin.ModelAdmin):
    list_display = ("job", "key", "layer", "fault_at", "detected_at", "first_step_at")
    list_filter = ("layer",)


@admin.register(models.Fault)
class FaultAdmin(admin.ModelAdmin):
    list_display = ("job", "fault_class", "rank", "node", "detected_by", "at", "lost_steps")
    list_filter = ("fault_class", "detected_by")


@admin.register(models.Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ("job", "step", "mode", "state", "blocking_s", "write_s", "bytes", "started_at")
    list_filter = ("state", "mode")


@admin.register(models.Command)
class CommandAdmin(admin.ModelAdmin):
    list_display = ("job", "kind", "level", "fault", "rank", "status", "issued_by", "issued_at", "acked_at")
    list_filter = ("kind", "status")


@admin.register(models.AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ("at", "actor_name", "action", "job", "remote_addr")
    list_filter = ("action",)

    def has_change_permission(self, request, obj=None):
        return False  # the audit log is append-only

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(models.Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ("job", "transition", "channel", "target", "created_at", "sent_at", "attempts")
    list_filter = ("transition", "channel")

from django.db import migrations, models
import django.db.models.deletion


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0014_fault_progress_at'),
    ]

    operations = [
        migrations.AddField(
            model_name='fault',
            name='primary',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                    related_name='echoes', to='jobs.fault'),
        ),
        migrations.AddField(
            model_name='fault',
            name='link',
            field=models.CharField(blank=True, choices=[('consequence', 'consequence'), ('repeat', 'repeat')],
                                   max_length=12),
        ),
        migrations.AddField(
            model_name='fault',
            name='why',
            field=models.CharField(blank=True, max_length=300),
        ),
        migrations.AddField(
            model_name='fault',
            name='count',
            field=models.IntegerField(default=1),
        ),
        migrations.AddField(
            model_name='fault',
            name='attributed_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
